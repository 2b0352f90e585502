use proptest::prelude::*;
use uuid::Uuid;

use super::*;
use crate::checkpoint::{Blob, DeltaVar, ObjectEntry, Payload};
use crate::codec::{self, CodecError};

fn uuid() -> impl Strategy<Value = Uuid> {
    any::<u128>().prop_map(Uuid::from_u128)
}

fn options() -> impl Strategy<Value = SessionOptions> {
    (".{0,40}", any::<bool>(), any::<bool>()).prop_map(|(cwd, all_gpu, speculate)| SessionOptions {
        cwd,
        all_gpu,
        speculate,
    })
}

fn roundtrip<M: WireMessage + PartialEq + std::fmt::Debug>(msg: &M) {
    let (headers, payload) = codec::encode(msg).unwrap();
    let back: M = codec::decode(Some(&headers), &payload).unwrap();
    assert_eq!(&back, msg);
}

proptest! {
    #[test]
    fn edit_roundtrips(session in uuid(), cell_id in ".{0,20}", code in ".{0,200}", seq in any::<u64>(), options in options()) {
        roundtrip(&EditV1 { session, cell_id, code, seq, options });
    }

    #[test]
    fn run_roundtrips(session in uuid(), exec_id in uuid(), code in ".{0,200}", t in any::<u64>(), rev in any::<u64>(), options in options(),
                      user_expressions in proptest::collection::btree_map("[a-z]{1,6}", ".{0,20}", 0..4),
                      gpu_refused in proptest::option::of(".{0,40}")) {
        roundtrip(&RunV3 { session, exec_id, cell_id: "c".into(), code, run_unix_ms: t, after_revision: rev, options, user_expressions, gpu_refused });
    }

    #[test]
    fn recipe_roundtrips(session in uuid(), names in proptest::collection::vec(("[a-z_]{1,8}", uuid()), 0..8),
                         imports in proptest::collection::vec("[a-z.]{1,10}", 0..5), gpu in any::<bool>(),
                         conservative in proptest::option::of(".{0,30}"), options in options()) {
        roundtrip(&RecipeV3 {
            session, cell_id: "c".into(), kind: RecipeKind::Run, exec_id: session, revision: 3,
            code: "x".into(), code_hash: 7,
            closure: names.into_iter().map(|(name, version)| ClosureVar { name, version }).collect(),
            imports, device: if gpu { Device::Gpu } else { Device::Cpu }, gpus: u32::from(gpu) * 2, device_reason: "r".into(),
            conservative, pinned: Some(PinnedWorker { host: "h".into(), worker: "w".into(), names: vec!["g".into()] }),
            manifest_revision: 1, run_unix_ms: 2, options,
            prepared: Some(PreparedWorker { host: "h".into(), worker: "w2".into() }), speculate: false,
            user_expressions: [("n".to_string(), "len(x)".to_string())].into(),
        });
    }

    #[test]
    fn event_roundtrips(session in uuid(), exec_id in uuid(), ms in any::<u64>(), run_ms in any::<f64>().prop_filter("nan", |f| !f.is_nan())) {
        for kind in [
            EventKind::Finished { status: CellStatus::Error, error: Some("ValueError: x".into()), execution_count: 3, run_ms, outputs: 2, cuda_used: true, faulted: vec!["v1".into()] },
            EventKind::Started { host: "h".into(), slot: Some(1), worker: "w".into(), device: Device::Gpu, prepare: Prepare::Cold, execution_count: 1, restored_bytes: 5, prepare_ms: run_ms, restore_ms: run_ms, refreshed: 2, import_hit: true, python: "3.11.7".into(), phases: StartPhases { claim_ms: run_ms, fork_ms: 1.0, ..StartPhases::default() } },
            EventKind::Failed { error: "worker died".into() },
            EventKind::Ready { host: "h".into(), slot: Some(0), worker: "w".into(), pid: 7, cell_id: "c".into(), revision: 2, class: PreparedClass::Speculative, prepare_ms: run_ms },
            EventKind::PreparedEnded { host: "h".into(), slot: None, worker: "w".into(), cell_id: "c".into(), class: PreparedClass::Warm, idle_ms: run_ms, outcome: PreparedOutcome::Used },
        ] {
            roundtrip(&SessionEventV2 { session, exec_id, unix_ms: ms, kind });
        }
    }

    #[test]
    fn commit_roundtrips(session in uuid(), names in proptest::collection::btree_map("[a-z]{1,6}", "[0-9a-f]{8}", 0..6), chunk in "[0-9a-f]{32}") {
        let mut delta = crate::checkpoint::Delta::default();
        for (name, oid) in &names {
            delta.variables.insert(name.clone(), DeltaVar { oid: Some(oid.clone()), module: None, global_reads: vec![] });
            delta.objects.insert(oid.clone(), ObjectEntry {
                record: Blob { len: 3, chunks: vec![chunk.clone()] },
                refs: vec![], payloads: vec![Payload { len: 9, chunks: vec![chunk.clone()], dtype: "f8".into(), shape: vec![3, 3], device: "cpu".into() }],
                modules: vec!["numpy".into()], on_gpu: false,
            });
        }
        roundtrip(&CommitV2 { session, base_revision: 4, exec_id: session, host: "h".into(), worker: "w".into(), cell_id: "c".into(), delta, uploaded: vec![chunk] });
    }

    #[test]
    fn input_reply_roundtrips(session in uuid(), value in ".{0,200}", refused in proptest::option::of(".{0,50}")) {
        roundtrip(&InputReplyV1 { session, exec_id: session, value, refused });
    }

    #[test]
    fn arbitrary_bytes_are_rejected_not_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let (headers, _) = codec::encode(&EditV1 { session: Uuid::nil(), cell_id: String::new(), code: String::new(), seq: 0, options: SessionOptions { cwd: String::new(), all_gpu: false, speculate: true } }).unwrap();
        // Whatever the bytes are, decoding either fails cleanly or yields a message
        // that re-encodes to the same bytes (it really was a valid payload).
        match codec::decode::<RecipeV3>(Some(&headers), &bytes) {
            Err(CodecError::WrongType { .. }) => {}
            other => prop_assert!(false, "expected WrongType, got {other:?}"),
        }
        match codec::decode::<EditV1>(Some(&headers), &bytes) {
            Err(_) => {}
            Ok(m) => prop_assert_eq!(codec::encode_bincode(&m).unwrap(), bytes),
        }
    }
}

#[test]
fn missing_headers_and_unknown_versions_are_rejected() {
    let msg = EditV1 {
        session: Uuid::nil(),
        cell_id: "c".into(),
        code: "x".into(),
        seq: 1,
        options: SessionOptions { cwd: String::new(), all_gpu: false, speculate: true },
    };
    let (mut headers, payload) = codec::encode(&msg).unwrap();
    assert!(matches!(codec::decode::<EditV1>(None, &payload), Err(CodecError::MissingHeaders)));
    headers.insert(codec::VERSION_HEADER, "99");
    assert!(matches!(
        codec::decode::<EditV1>(Some(&headers), &payload),
        Err(CodecError::UnsupportedVersion { version: 99, .. })
    ));
    headers.insert(codec::VERSION_HEADER, "one");
    assert!(matches!(codec::decode::<EditV1>(Some(&headers), &payload), Err(CodecError::BadVersion(_))));
}

#[test]
fn a_version_1_host_status_is_read_as_version_2() {
    let sid = Uuid::now_v7();
    let v1 = HostStatusV1 {
        host: "old-host".into(),
        slots: vec![],
        real_gpus: false,
        zygotes: vec![],
        cpu_sessions: vec![sid],
        workers: 3,
        cache_bytes: 7,
        forks: 9,
        unix_ms: 11,
    };
    // what an older host sends: the V1 layout under version 1 of the same type
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(codec::TYPE_HEADER, HostStatusV2::TYPE);
    headers.insert(codec::VERSION_HEADER, "1");
    let payload = codec::encode_bincode(&v1).unwrap();
    let v2: HostStatusV2 = codec::decode(Some(&headers), &payload).unwrap();
    assert_eq!(v2, v1.clone().upgrade());
    assert_eq!((v2.host.as_str(), v2.cpu_sessions, v2.forks, v2.workers.len()), ("old-host", vec![sid], 9, 0));
    // and the current version round-trips with its worker states
    roundtrip(&HostStatusV2 {
        workers: vec![WorkerStatus { id: "w".into(), pid: 5, session: sid, state: WorkerState::Saving, for_ms: 2 }],
        ..v1.upgrade()
    });
}

/// What an older sender puts on the wire: the V1 layout under version 1 of the type.
fn decode_as_version_1<Old: serde::Serialize, New: WireMessage>(old: &Old) -> New {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(codec::TYPE_HEADER, New::TYPE);
    headers.insert(codec::VERSION_HEADER, "1");
    codec::decode(Some(&headers), &codec::encode_bincode(old).unwrap()).unwrap()
}

#[test]
fn a_version_1_commit_and_manifest_get_are_read_as_version_2() {
    let sid = Uuid::now_v7();
    let old = CommitV1 {
        session: sid,
        base_revision: 2,
        exec_id: sid,
        host: "h".into(),
        worker: "w".into(),
        cell_id: "c".into(),
        delta: Default::default(),
    };
    let new: CommitV2 = decode_as_version_1(&old);
    assert_eq!((new.session, new.base_revision, new.uploaded.len()), (sid, 2, 0), "an old commit claims no uploads");
    assert_eq!(new, old.upgrade());
    let get: ManifestGetV2 = decode_as_version_1(&ManifestGetV1 { session: sid });
    assert_eq!(get, ManifestGetV2 { session: sid, at_least: None }, "an old get names no known revision");
    roundtrip(&ManifestGetV2 { session: sid, at_least: Some(7) });
}

#[test]
fn reply_envelope_carries_typed_errors() {
    let err: Reply<DoneV1> = Reply::Err { code: ErrorCode::Conflict, message: "revision 3 exists".into() };
    roundtrip(&err);
    roundtrip(&Reply::Ok(DoneV1 {}));
}

proptest! {
    #[test]
    fn output_pieces_reassemble_to_the_message(text in ".{0,300}", max in 4usize..64) {
        let message = CellMessage::Output(serde_json::json!({"output_type": "stream", "name": "stdout", "text": text}));
        let pieces = OutputV2::pieces(Uuid::nil(), Uuid::nil(), 3, message.clone(), max);
        let mut joined = String::new();
        for (i, p) in pieces.iter().enumerate() {
            prop_assert_eq!(p.seq, 3);
            match &p.body {
                OutputBody::Whole(whole) => {
                    prop_assert_eq!(pieces.len(), 1);
                    prop_assert_eq!(whole, &message);
                    return Ok(());
                }
                OutputBody::Piece { part, parts, text } => {
                    prop_assert!(text.len() <= max.max(4) && *parts as usize == pieces.len() && *part as usize == i);
                    joined.push_str(text);
                }
            }
        }
        prop_assert_eq!(CellMessage::from_json_text(&joined).unwrap(), message);
    }
}

/// Each kind of cell message: through bincode, and through the HTTP API's JSON
/// and back, as itself.
#[test]
fn cell_messages_keep_their_kind_on_the_bus_and_in_json() {
    use serde_json::json;
    let messages = [
        CellMessage::Output(json!({"output_type": "display_data", "data": {"text/plain": "1"}, "metadata": {}})),
        CellMessage::Output(json!({"output_type": "clear_output", "wait": true})),
        CellMessage::InputRequest { prompt: "name? ".into(), password: true },
        CellMessage::Comm(CommToClient {
            msg_type: "comm_open".into(),
            content: json!({"comm_id": "c", "target_name": "jupyter.widget", "data": {"state": {}}}),
            metadata: json!({"version": "2.1.0"}),
            buffers: vec!["AAE=".into()],
        }),
        CellMessage::UserExpressions(json!({"n": {"status": "ok", "data": {"text/plain": "2"}, "metadata": {}}})),
        CellMessage::Pager { data: json!({"text/plain": "Docstring"}), start: 3 },
    ];
    for m in messages {
        let out = OutputV2 { session: Uuid::nil(), exec_id: Uuid::nil(), seq: 1, body: OutputBody::Whole(m.clone()) };
        roundtrip(&out);
        assert_eq!(CellMessage::from_json(m.to_json()).unwrap(), m);
    }
    let answer =
        CommAnswerV2 { reply_json: "{}".into(), messages: vec![CellMessage::Output(json!({"output_type": "stream"}))] };
    roundtrip(&answer);
}

/// JSON that is no cell message is refused with what is wrong, never taken for
/// an output.
#[test]
fn json_that_is_no_cell_message_is_refused_by_name() {
    use serde_json::json;
    assert_eq!(CellMessage::from_json(json!({"text": "x"})), Err(CellMessageError::NoKind));
    assert_eq!(
        CellMessage::from_json(json!({"output_type": "sparkle"})),
        Err(CellMessageError::UnknownKind("sparkle".into()))
    );
    let comm =
        CellMessage::from_json(json!({"output_type": "comm", "msg_type": "comm_msg", "metadata": {}, "buffers": []}));
    assert_eq!(comm, Err(CellMessageError::BadField { kind: "comm", field: "content", expected: "object" }));
    let ask = CellMessage::from_json(json!({"output_type": "input_request", "prompt": "?", "password": "no"}));
    assert!(ask.unwrap_err().to_string().contains("password"));
    assert!(matches!(CellMessage::from_json_text("{"), Err(CellMessageError::NotJson(_))));
}

/// Every bus decoder, fed bytes it did not encode: random bytes, and valid
/// messages with bytes changed, cut short or extended. Decoding fails with an
/// error or yields a message; it never panics (a service decodes what the
/// network sends it).
mod fuzz {
    use super::*;

    fn headers_of<M: WireMessage>() -> async_nats::HeaderMap {
        let mut h = async_nats::HeaderMap::new();
        h.insert(codec::TYPE_HEADER, M::TYPE);
        h.insert(codec::VERSION_HEADER, M::VERSION.to_string().as_str());
        h
    }

    /// Decode `bytes` as every message type at its current version and at 1 (the
    /// upgrade paths): only errors or messages come back.
    fn decode_all(bytes: &[u8]) {
        macro_rules! each {
            ($($m:ty),* $(,)?) => {$(
                let _ = codec::decode::<$m>(Some(&headers_of::<$m>()), bytes);
                let mut old = headers_of::<$m>();
                old.insert(codec::VERSION_HEADER, "1");
                let _ = codec::decode::<$m>(Some(&old), bytes);
            )*};
        }
        each!(
            EditV1,
            RunV3,
            RecipeV3,
            SessionEventV2,
            OutputV2,
            SessionCloseV1,
            SessionIdleV1,
            InterruptV1,
            InputReplyV1,
            QueryV1,
            QueryAnswerV1,
            Reply<QueryAnswerV1>,
            CommV1,
            CommAnswerV2,
            Reply<CommAnswerV2>,
            HostStatusV2,
            BidV1,
            GpuDemandV1,
            EvictV1,
            ManifestGetV2,
            ChunkPlanV2,
            ChunkPlannedV1,
            ManifestV2,
            CommitV2,
            CommittedV1,
            SessionDeleteV1,
            SettleV1,
            GcV1,
            GcDoneV1,
            RevertV1,
            ForkV1,
            StateMovedV1,
            StateCheckV1,
            StateCheckedV1,
            StorePressureV1,
            DoneV1,
            Reply<ManifestV2>,
            Reply<CommittedV1>,
        );
    }

    fn valid_payloads() -> Vec<Vec<u8>> {
        let ev = SessionEventV2 {
            session: Uuid::nil(),
            exec_id: Uuid::nil(),
            unix_ms: 5,
            kind: EventKind::Failed { error: "worker died".into() },
        };
        let run = RunV3 {
            session: Uuid::nil(),
            exec_id: Uuid::nil(),
            cell_id: "c".into(),
            code: "x = 1".into(),
            run_unix_ms: 1,
            after_revision: 2,
            options: SessionOptions { cwd: "/tmp".into(), all_gpu: true, speculate: false },
            user_expressions: Default::default(),
            gpu_refused: Some("over quota".into()),
        };
        let manifest = ManifestV2 { manifest: crate::checkpoint::Manifest::empty(Uuid::nil()) };
        vec![
            codec::encode(&ev).map(|e| e.1.to_vec()).unwrap_or_default(),
            codec::encode(&run).map(|e| e.1.to_vec()).unwrap_or_default(),
            codec::encode(&manifest).map(|e| e.1.to_vec()).unwrap_or_default(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn random_bytes_never_panic_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            decode_all(&bytes);
        }

        #[test]
        fn changed_valid_messages_never_panic_a_decoder(
            which in 0usize..3,
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let mut bytes = valid_payloads().swap_remove(which);
            prop_assume!(!bytes.is_empty());
            for (at, b) in &flips {
                let i = at.index(bytes.len());
                bytes[i] ^= b | 1;
            }
            decode_all(&bytes);
            let mut short = bytes.clone();
            short.truncate(cut.index(bytes.len()));
            decode_all(&short);
            bytes.extend(tail);
            decode_all(&bytes);
        }
    }
}
