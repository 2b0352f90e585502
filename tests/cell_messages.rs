//! What a cell sends its client travels typed from the worker to the client
//! (ADR 61): an input request, a pager's text, user expressions and comm
//! messages are each their own `CellMessage` on the bus and in the event stream,
//! never an output of the notebook, and each reaches the client as itself.

use std::collections::BTreeMap;

use looseleaf_client::api::{CommMessage, ExecStatus, RunCell, StreamItem};
use looseleaf_test_support::cluster::{bin_dir_of, Services};
use schemas::messages::{CellMessage, OutputBody, OutputV2};
use schemas::Bus;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread")]
async fn an_input_request_a_pager_user_expressions_and_comms_each_travel_as_themselves() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    let services = Services::start(&bin, &[1], &[]).await?;
    let mut s = services.session(false).await?;
    let bus = Bus::connect(services.nats.url(), &services.prefix, "cell-messages-test").await?;
    let mut on_bus = bus.subscribe::<OutputV2>(bus.subjects().session_outputs(s.sid)).await?;

    // input(): the client is asked, answers, and the cell goes on with the answer
    let asking = RunCell {
        code: "name = input('name? ')\nprint('hi', name)".into(),
        allow_stdin: true,
        user_expressions: BTreeMap::from([("n".to_string(), "len(name)".to_string())]),
    };
    let exec = s.fe.run_cell(s.sid, "ask", &asking).await?.exec_id;
    let asked = s.events.until(|i| sent(i, exec, |m| matches!(m, CellMessage::InputRequest { .. }))).await?;
    let StreamItem::Output { output: CellMessage::InputRequest { prompt, password }, .. } = asked else {
        unreachable!("until returned what it waited for")
    };
    assert_eq!((prompt.as_str(), password), ("name? ", false));
    s.fe.input(s.sid, exec, "Ada").await?;
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    let of_ask = messages_of(&s.events.seen, exec);
    let user_expressions = of_ask.iter().find_map(|m| match m {
        CellMessage::UserExpressions(data) => Some(data.clone()),
        _ => None,
    });
    assert_eq!(user_expressions.map(|d| d["n"]["data"]["text/plain"].clone()), Some("3".into()), "{of_ask:#?}");
    assert!(of_ask.iter().any(|m| m.output().is_some_and(|o| o["text"] == "hi Ada\n")), "{of_ask:#?}");

    // `obj?`: the pager's text, not an output
    let exec = s.fe.run(s.sid, "help", "len?").await?.exec_id;
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    let of_help = messages_of(&s.events.seen, exec);
    let [CellMessage::Pager { data, .. }] = of_help.as_slice() else {
        panic!("one pager message expected: {of_help:#?}")
    };
    assert!(data["text/plain"].as_str().is_some_and(|t| t.contains("Return the number of items")), "{data}");

    // a widget: its comm_open, and a display of its view
    let exec =
        s.fe.run(s.sid, "slider", "import ipywidgets\nslider = ipywidgets.IntSlider(value=3)\nslider").await?.exec_id;
    assert_eq!(s.events.outcome(exec).await?.0, ExecStatus::Ok);
    let of_slider = messages_of(&s.events.seen, exec);
    let opened = of_slider.iter().find_map(|m| match m {
        CellMessage::Comm(c)
            if c.msg_type == "comm_open" && c.content["data"]["state"]["_model_name"] == "IntSliderModel" =>
        {
            Some(c.content["comm_id"].clone())
        }
        _ => None,
    });
    let Some(comm_id) = opened else { panic!("no comm_open of the slider: {of_slider:#?}") };
    let view = of_slider.iter().filter_map(CellMessage::output).find(|o| o["output_type"] == "execute_result");
    assert_eq!(
        view.map(|o| o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"].clone()),
        Some(comm_id.clone())
    );

    // the client asks the widget for its state between cells: the answer's comm
    // message comes back typed through the session's CPU worker
    let ask_state = CommMessage {
        msg_type: "comm_msg".into(),
        content: serde_json::json!({"comm_id": comm_id, "data": {"method": "request_state"}}),
        metadata: serde_json::json!({}),
        buffers: vec![],
    };
    let answer = s.fe.comm(s.sid, &ask_state).await?;
    assert!(answer.held, "the session's CPU worker holds the slider");
    let state = answer.outputs.iter().find_map(|m| match m {
        CellMessage::Comm(c) if c.content["data"]["method"] == "update" => {
            Some(c.content["data"]["state"]["value"].clone())
        }
        _ => None,
    });
    assert_eq!(state, Some(3.into()), "{:#?}", answer.outputs);

    // on the bus, each was its own kind: no notebook output names a side channel
    let mut kinds = BTreeMap::<&str, usize>::new();
    while let Ok(Some(item)) = tokio::time::timeout(std::time::Duration::from_secs(2), on_bus.next()).await {
        let OutputBody::Whole(message) = item.map_err(|e| anyhow::anyhow!("{e:?}"))?.msg.body else { continue };
        let kind = match &message {
            CellMessage::Output(o) => {
                let t = o["output_type"].as_str().unwrap_or_default();
                assert!(!["input_request", "pager", "comm", "user_expressions"].contains(&t), "{o}");
                "output"
            }
            CellMessage::InputRequest { .. } => "input_request",
            CellMessage::Comm(_) => "comm",
            CellMessage::UserExpressions(_) => "user_expressions",
            CellMessage::Pager { .. } => "pager",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    for kind in ["output", "input_request", "comm", "user_expressions", "pager"] {
        assert!(kinds.contains_key(kind), "no {kind} on the bus: {kinds:?}");
    }
    Ok(())
}

/// Whether `item` is something execution `exec` sent for which `what` holds.
fn sent(item: &StreamItem, exec: Uuid, what: impl Fn(&CellMessage) -> bool) -> bool {
    matches!(item, StreamItem::Output { exec_id, output, .. } if *exec_id == exec && what(output))
}

/// What execution `exec` sent its client, in order.
fn messages_of(seen: &[StreamItem], exec: Uuid) -> Vec<CellMessage> {
    let mut sent: Vec<(u64, CellMessage)> = seen
        .iter()
        .filter_map(|i| match i {
            StreamItem::Output { exec_id, seq, output } if *exec_id == exec => Some((*seq, output.clone())),
            _ => None,
        })
        .collect();
    sent.sort_by_key(|(seq, _)| *seq);
    sent.into_iter().map(|(_, m)| m).collect()
}
