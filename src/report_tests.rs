use super::*;
use looseleaf_client::events::{Device, Prepare, PreparedOutcome, SlotUse, StartPhases};

/// The JSON Schema the report's `$schema` URL names, as the repository keeps it.
const SCHEMA: &str = include_str!("../docs/report.schema.json");

fn started(at: u64, device: Device) -> (u64, Event) {
    (
        at,
        Event::Started {
            host: "host-0".into(),
            slot: Some(1),
            worker: "w".into(),
            device,
            prepare: Prepare::Speculative,
            execution_count: 1,
            restored_bytes: 10,
            prepare_ms: 1.0,
            restore_ms: 0.5,
            refreshed: 0,
            import_hit: true,
            python: "3.11.7".into(),
            phases: StartPhases { claim_ms: 0.25, fork_ms: 0.5, ..StartPhases::default() },
        },
    )
}

fn trace(index: usize, run: u64, start: u64, done: u64, device: Device) -> Trace {
    Trace {
        index,
        cell_id: format!("cell-{index}"),
        exec_id: Uuid::now_v7(),
        run_unix_ms: run,
        events: vec![started(start, device)],
        outputs: vec![],
        done: Some((ExecStatus::Ok, done, None)),
    }
}

#[test]
fn start_delay_counts_from_run_or_the_previous_cells_end_whichever_is_later() {
    // cell 0: run at 1000, starts 1200 -> 200 ms
    // cell 1: run at 1500 but cell 0 ends at 3000; starts 3100 -> 100 ms, not 1600
    // cell 2: run at 5000, after cell 1 ended at 4000; starts 5050 -> 50 ms
    let traces = vec![
        trace(0, 1000, 1200, 3000, Device::Gpu),
        trace(2, 1500, 3100, 4000, Device::Cpu),
        trace(3, 5000, 5050, 6000, Device::Gpu),
    ];
    let mut log = SessionLog::default();
    for (held_ms, reason) in [(1500.0, SlotUse::Cell), (2500.0, SlotUse::UnsavableState)] {
        log.absorb(0, &Event::SlotReleased { host: "h".into(), slot: 0, held_ms, reason });
    }
    let r = build("nb.ipynb", &traces, &log, 7.5, std::time::UNIX_EPOCH);
    let delays: Vec<_> = r.cells.iter().map(|c| c.start_delay_ms).collect();
    assert_eq!(delays, vec![Some(200), Some(100), Some(50)]);
    assert_eq!(r.totals.median_start_delay_ms, Some(100.0));
    assert_eq!((r.totals.cells, r.totals.ok, r.totals.errors), (3, 3, 0));
    assert_eq!((r.totals.gpu_cells, r.totals.cpu_cells), (2, 1));
    assert!((r.totals.gpu_slot_seconds - 4.0).abs() < 1e-9);
    assert!((r.totals.pinned_seconds - 2.5).abs() < 1e-9);
    assert_eq!(r.cells[1].prepare.as_deref(), Some("speculative"));
    assert_eq!((r.cells[0].host.as_deref(), r.cells[0].slot), (Some("host-0"), Some(1)));
    // the host's phases of the start reach the report
    assert_eq!(r.cells[0].phases.map(|p| (p.claim_ms, p.fork_ms)), Some((0.25, 0.5)));
}

#[test]
fn a_start_before_run_never_underflows_and_failed_cells_count_as_errors() {
    let mut t = trace(0, 1000, 900, 2000, Device::Gpu);
    t.events.push((1950, Event::Failed { error: "worker died".into() }));
    t.done = Some((ExecStatus::Failed, 2000, Some("worker died".into())));
    let never = Trace { index: 1, exec_id: Uuid::now_v7(), run_unix_ms: 2100, ..Default::default() };
    let r = build("nb", &[t, never], &SessionLog::default(), 1.0, std::time::UNIX_EPOCH);
    assert_eq!(r.cells[0].start_delay_ms, Some(0));
    assert_eq!(r.cells[0].status, "failed", "the platform failed it: not the cell's own error");
    assert_eq!(r.cells[0].error.as_deref(), Some("worker died"));
    assert_eq!(r.cells[1].status, "failed");
    assert_eq!(r.cells[1].start_delay_ms, None);
    assert_eq!((r.totals.ok, r.totals.errors), (0, 2));
    assert_eq!(r.totals.median_start_delay_ms, Some(0.0));
}

#[test]
fn a_cell_that_raised_reports_the_error() {
    let mut t = trace(0, 0, 10, 20, Device::Cpu);
    t.events.push((
        15,
        Event::Finished {
            faulted: vec!["shown".into()],
            status: CellStatus::Error,
            error: Some("ZeroDivisionError: division by zero".into()),
            execution_count: 3,
            run_ms: 4.0,
            outputs: 1,
            cuda_used: false,
        },
    ));
    let c = CellReport::from_trace(&t, None);
    assert_eq!(c.status, "error");
    assert_eq!(c.faulted, vec!["shown".to_string()]);
    assert_eq!(c.run_ms, Some(4.0));
    assert_eq!(t.execution_count(), Some(3));
}

#[test]
fn median_of_even_and_empty_lists() {
    assert_eq!(median(&[]), None);
    assert_eq!(median(&[4, 1, 3, 2]), Some(2.5));
}

#[test]
fn speculation_totals_count_clean_hits_and_idle_time_by_class() {
    let mut hit = trace(0, 1000, 1010, 2000, Device::Gpu);
    let mut refreshed = trace(1, 3000, 3010, 4000, Device::Gpu);
    if let Event::Started { refreshed: r, .. } = &mut refreshed.events[0].1 {
        *r = 2;
    }
    let mut cold = trace(2, 5000, 5100, 6000, Device::Gpu);
    if let Event::Started { prepare, .. } = &mut cold.events[0].1 {
        *prepare = Prepare::Cold;
    }
    hit.cell_id = "a".into();
    let mut log = SessionLog::default();
    let ended = |class, idle_ms, outcome, slot| Event::PreparedEnded {
        host: "h".into(),
        slot,
        worker: "w".into(),
        cell_id: "a".into(),
        class,
        idle_ms,
        outcome,
    };
    let ready = |revision, class| Event::Ready {
        host: "h".into(),
        slot: Some(0),
        worker: "w".into(),
        pid: 7,
        cell_id: "a".into(),
        revision,
        class,
        prepare_ms: 30.0,
    };
    log.absorb(900, &ready(1, PreparedClass::Speculative));
    // ready again after its cell started (kept warm): not when it was ready for it
    log.absorb(2500, &ready(2, PreparedClass::Warm));
    log.absorb(0, &ended(PreparedClass::Speculative, 1500.0, PreparedOutcome::Used, Some(0)));
    log.absorb(0, &ended(PreparedClass::Speculative, 500.0, PreparedOutcome::Evicted, Some(1)));
    log.absorb(0, &ended(PreparedClass::Speculative, 4000.0, PreparedOutcome::Used, None));
    log.absorb(0, &ended(PreparedClass::Warm, 250.0, PreparedOutcome::Evicted, Some(0)));
    let r = build("nb", &[hit, refreshed, cold], &log, 1.0, std::time::UNIX_EPOCH);
    let s = &r.totals.speculation;
    assert_eq!((s.ready_events, s.prepared_cells, s.clean_hits, s.unused), (2, 2, 1, 2));
    assert_eq!(s.hit_rate, Some(1.0 / 3.0));
    // a worker prepared on the CPU waited 4 s without costing slot time
    assert!((s.speculative_idle_slot_seconds - 2.0).abs() < 1e-9);
    assert!((s.speculative_idle_worker_seconds - 6.0).abs() < 1e-9);
    assert!((s.warm_idle_slot_seconds - 0.25).abs() < 1e-9);
    assert_eq!(r.cells[1].refreshed, Some(2));
    // the cells that ran on worker w (prepared) say when it was ready; the cold one none
    assert_eq!((r.cells[0].prepared_unix_ms, r.cells[2].prepared_unix_ms), (Some(900), None));
}

#[test]
fn the_report_says_what_it_is_and_when_it_ran() {
    let r = build(
        "nb",
        &[],
        &SessionLog::default(),
        0.0,
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_796_029_707),
    );
    assert_eq!(r.started_at, "2026-11-30T09:08:27Z");
    assert_eq!(r.report_version, REPORT_VERSION);
    assert_eq!(r.looseleaf_version, env!("CARGO_PKG_VERSION"));
    let json = serde_json::to_value(&r).unwrap_or_default();
    // the report names its schema by a URL of its layout version, the schema's own `$id`
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap_or_default();
    assert_eq!(json["$schema"], format!("https://looseleaf.dev/schemas/report/v{REPORT_VERSION}.json"));
    assert_eq!(json["$schema"], schema["$id"]);
    assert_eq!(schema["properties"]["$schema"]["enum"][0], schema["$id"]);
    assert_eq!(schema["properties"]["report_version"]["const"], REPORT_VERSION);
    // every field the report has is described by the schema, and the schema is JSON
    for key in json.as_object().into_iter().flatten().map(|(k, _)| k) {
        assert!(schema["properties"].get(key).is_some(), "{key} is not in the schema");
    }
    let cell = serde_json::to_value(CellReport::default()).unwrap_or_default();
    for key in cell.as_object().into_iter().flatten().map(|(k, _)| k) {
        assert!(schema["$defs"]["cell"]["properties"].get(key).is_some(), "cell field {key} is not in the schema");
    }
    let totals = serde_json::to_value(&r.totals).unwrap_or_default();
    for key in totals.as_object().into_iter().flatten().map(|(k, _)| k) {
        assert!(schema["$defs"]["totals"]["properties"].get(key).is_some(), "totals field {key} is not in the schema");
    }
}

/// `looseleaf run` writes a notebook: of what a cell sends its client, it keeps
/// the notebook outputs, never a pager's text, a comm message or user expressions.
#[test]
fn a_trace_keeps_notebook_outputs_and_no_side_channel() {
    use schemas::messages::CommToClient;
    let exec_id = Uuid::now_v7();
    let stream = serde_json::json!({"output_type": "stream", "name": "stdout", "text": "hi\n"});
    let sent = [
        CellMessage::Pager { data: serde_json::json!({"text/plain": "Doc"}), start: 0 },
        CellMessage::Output(stream.clone()),
        CellMessage::Comm(CommToClient {
            msg_type: "comm_open".into(),
            content: serde_json::json!({"comm_id": "c"}),
            metadata: serde_json::json!({}),
            buffers: vec![],
        }),
        CellMessage::UserExpressions(serde_json::json!({})),
    ];
    let mut t = Trace { exec_id, ..Default::default() };
    for (seq, output) in (1..).zip(sent) {
        t.push(StreamItem::Output { exec_id, seq, output });
    }
    assert_eq!(t.sorted_outputs(), vec![stream]);
}

/// The report is one file: its schema is named by URL, never written beside it.
#[test]
fn writing_a_report_writes_only_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nb.looseleaf.json");
    let r = build(
        "nb.ipynb",
        &[trace(0, 1000, 1200, 3000, Device::Cpu)],
        &SessionLog::default(),
        1.0,
        std::time::UNIX_EPOCH,
    );
    write(&r, &path).unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files, vec![std::ffi::OsString::from("nb.looseleaf.json")]);
    let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(back["$schema"], schema_url());
    assert_eq!(back["cells"][0]["status"], "ok");
}
