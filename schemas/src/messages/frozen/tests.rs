//! Golden bytes: each frozen version's encoding of one fixed message, as it was
//! when the version was frozen. A test here fails when an edit changes what a
//! frozen version puts on the wire; the fix is to undo the edit, never the bytes.
//! Each test also reads the bytes as the current version (the upgrade path).

use uuid::Uuid;

use super::*;
use crate::codec::{decode_bincode, encode_bincode, WireMessage};
use crate::messages::{
    self as live, ChunkPlanV2, CommitV2, HostStatusV2, ManifestGetV2, OutputV2, PreparedOutcome, RecipeV3, RunV3,
    SessionEventV2, SlotUse,
};

const SESSION: Uuid = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001);
const EXEC: Uuid = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0002);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `msg` encodes to `golden`, and the current type `New` reads those bytes as
/// version 1.
fn pinned<Old: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug, New: WireMessage>(
    msg: &Old,
    golden: &str,
) -> New {
    pinned_at(1, msg, golden)
}

/// `msg` encodes to `golden`, and the current type `New` reads those bytes as
/// `version`.
fn pinned_at<Old: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug, New: WireMessage>(
    version: u16,
    msg: &Old,
    golden: &str,
) -> New {
    let bytes = encode_bincode(msg).unwrap();
    assert_eq!(hex(&bytes), golden, "the frozen encoding changed");
    assert_eq!(&decode_bincode::<Old>(&bytes).unwrap(), msg);
    New::decode_version(version, &bytes).unwrap()
}

#[test]
fn chunk_plan_v1_bytes() {
    let now: ChunkPlanV2 = pinned(&ChunkPlanV1 { session: SESSION, hashes: vec!["ab".into()] }, CHUNK_PLAN_V1);
    assert_eq!(now, ChunkPlanV2 { session: SESSION, hashes: vec!["ab".into()], bytes_after: None });
}
const CHUNK_PLAN_V1: &str = "100190000000007000800000000000000101026162";

#[test]
fn manifest_get_v1_bytes() {
    let now: ManifestGetV2 = pinned(&ManifestGetV1 { session: SESSION }, MANIFEST_GET_V1);
    assert_eq!(now, ManifestGetV2 { session: SESSION, at_least: None });
}
const MANIFEST_GET_V1: &str = "1001900000000070008000000000000001";

#[test]
fn output_v1_bytes() {
    let v1 = OutputV1 {
        session: SESSION,
        exec_id: EXEC,
        seq: 4,
        output_json: r#"{"output_type":"pager","data":{"text/plain":"Doc"}}"#.into(),
        part: 0,
        parts: 1,
    };
    let now: OutputV2 = pinned(&v1, OUTPUT_V1);
    let live::OutputBody::Piece { part: 0, parts: 1, text } = now.body else { panic!("not one piece: {:?}", now.body) };
    let message = live::CellMessage::from_json_text(&text).unwrap();
    assert_eq!(message, live::CellMessage::Pager { data: serde_json::json!({"text/plain": "Doc"}), start: 0 });
}
const OUTPUT_V1: &str = "1001900000000070008000000000000001100190000000007000800000000000000204337b226f75747075745f74797065223a227061676572222c2264617461223a7b22746578742f706c61696e223a22446f63227d7d0001";

#[test]
fn run_v1_bytes() {
    let options = run_v1::SessionOptions { cwd: "/nb".into(), all_gpu: true, speculate: false };
    let v1 = RunV1 {
        session: SESSION,
        exec_id: EXEC,
        cell_id: "c".into(),
        code: "x = 1".into(),
        run_unix_ms: 7,
        after_revision: 3,
        options,
    };
    let now: RunV3 = pinned(&v1, RUN_V1);
    assert_eq!(now.code, "x = 1");
    assert_eq!(now.options, live::SessionOptions { cwd: "/nb".into(), all_gpu: true, speculate: false });
    assert!(now.user_expressions.is_empty(), "a version 1 run asks for no user expressions");
    assert_eq!(now.gpu_refused, None, "no quota refused a version 1 run");
}
const RUN_V1: &str =
    "1001900000000070008000000000000001100190000000007000800000000000000201630578203d20310703032f6e620100";

#[test]
fn run_v2_bytes() {
    let options = run_v1::SessionOptions { cwd: "/nb".into(), all_gpu: false, speculate: true };
    let v2 = RunV2 {
        session: SESSION,
        exec_id: EXEC,
        cell_id: "c".into(),
        code: "x = 1".into(),
        run_unix_ms: 7,
        after_revision: 3,
        options,
        user_expressions: [("n".to_string(), "x".to_string())].into(),
    };
    let now: RunV3 = pinned_at(2, &v2, RUN_V2);
    assert_eq!(now.user_expressions.get("n").map(String::as_str), Some("x"));
    assert_eq!(now.options, live::SessionOptions { cwd: "/nb".into(), all_gpu: false, speculate: true });
    assert_eq!(now.gpu_refused, None, "no quota refused a version 2 run");
}
const RUN_V2: &str =
    "1001900000000070008000000000000001100190000000007000800000000000000201630578203d20310703032f6e62000101016e0178";

#[test]
fn recipe_v1_bytes() {
    let v1 = RecipeV1 {
        session: SESSION,
        cell_id: "c".into(),
        kind: recipe_v1::RecipeKind::Run,
        exec_id: EXEC,
        revision: 2,
        code: "y = x".into(),
        code_hash: 9,
        closure: vec![recipe_v1::ClosureVar { name: "x".into(), version: EXEC }],
        imports: vec!["numpy".into()],
        device: recipe_v1::Device::Gpu,
        device_reason: "torch".into(),
        conservative: None,
        pinned: Some(recipe_v1::PinnedWorker { host: "h".into(), worker: "w".into(), names: vec!["g".into()] }),
        manifest_revision: 4,
        run_unix_ms: 5,
        options: run_v1::SessionOptions { cwd: "/nb".into(), all_gpu: false, speculate: true },
        prepared: Some(recipe_v1::PreparedWorker { host: "h".into(), worker: "w2".into() }),
        speculate: false,
    };
    let now: RecipeV3 = pinned(&v1, RECIPE_V1);
    assert_eq!((now.kind, now.device, now.gpus), (live::RecipeKind::Run, live::Device::Gpu, 1));
    assert_eq!(now.closure, vec![live::ClosureVar { name: "x".into(), version: EXEC }]);
    assert_eq!(now.pinned.map(|p| p.names), Some(vec!["g".to_string()]));
    assert_eq!(now.prepared, Some(live::PreparedWorker { host: "h".into(), worker: "w2".into() }));
    assert!(now.options.speculate && now.user_expressions.is_empty());
}
const RECIPE_V1: &str = "10019000000000700080000000000000010163011001900000000070008000000000000002020579203d207809010178100190000000007000800000000000000201056e756d70790105746f7263680001016801770101670405032f6e62000101016802773200";

#[test]
fn recipe_v2_bytes() {
    let v2 = RecipeV2 {
        session: SESSION,
        cell_id: "c".into(),
        kind: recipe_v1::RecipeKind::Speculative,
        exec_id: Uuid::nil(),
        revision: 2,
        code: "y = x".into(),
        code_hash: 9,
        closure: vec![recipe_v1::ClosureVar { name: "x".into(), version: EXEC }],
        imports: vec![],
        device: recipe_v1::Device::Cpu,
        device_reason: "none".into(),
        conservative: Some("eval".into()),
        pinned: None,
        manifest_revision: 4,
        run_unix_ms: 0,
        options: run_v1::SessionOptions { cwd: "/nb".into(), all_gpu: false, speculate: true },
        prepared: None,
        speculate: true,
        user_expressions: [("a".to_string(), "x + 1".to_string())].into(),
    };
    let now: RecipeV3 = pinned_at(2, &v2, RECIPE_V2);
    assert_eq!((now.kind, now.device, now.gpus), (live::RecipeKind::Speculative, live::Device::Cpu, 0));
    assert_eq!(now.conservative.as_deref(), Some("eval"));
    assert_eq!(now.user_expressions.get("a").map(String::as_str), Some("x + 1"));
    assert!(now.speculate && now.options.speculate);
}
const RECIPE_V2: &str = "10019000000000700080000000000000010163001000000000000000000000000000000000020579203d20780901017810019000000000700080000000000000020000046e6f6e6501046576616c000400032f6e62000100010101610578202b2031";

#[test]
fn host_status_v1_bytes() {
    let v1 = HostStatusV1 {
        host: "h".into(),
        slots: vec![host_status_v1::SlotStatus {
            index: 1,
            name: "virtual".into(),
            memory_bytes: 0,
            exec_id: Some(EXEC),
            session: Some(SESSION),
            held_for: Some("cell".into()),
        }],
        real_gpus: false,
        zygotes: vec![host_status_v1::ZygoteStatus {
            id: "z".into(),
            packages: vec!["numpy".into()],
            cuda_unsafe: vec![],
            pid: 7,
        }],
        cpu_sessions: vec![SESSION],
        workers: 3,
        cache_bytes: 1 << 20,
        forks: 9,
        unix_ms: 1_700_000_000_000,
    };
    let now: HostStatusV2 = pinned(&v1, HOST_STATUS_V1);
    assert_eq!((now.slots[0].held_for.as_deref(), now.zygotes[0].pid, now.workers.len()), (Some("cell"), 7, 0));
}
const HOST_STATUS_V1: &str = "01680101077669727475616c00011001900000000070008000000000000002011001900000000070008000000000000001010463656c6c0001017a01056e756d7079000701100190000000007000800000000000000103fc0000100009fd0068e5cf8b010000";

#[test]
fn commit_v1_bytes() {
    let blob = commit_v1::Blob { len: 9, chunks: vec!["c0".into()] };
    let mut delta = commit_v1::Delta::default();
    delta.variables.insert(
        "x".into(),
        commit_v1::DeltaVar { oid: Some("o1".into()), module: None, global_reads: vec!["y".into()] },
    );
    delta.deleted.push("old".into());
    delta.objects.insert(
        "o1".into(),
        commit_v1::ObjectEntry {
            record: blob.clone(),
            refs: vec![],
            payloads: vec![commit_v1::Payload {
                len: 72,
                chunks: vec!["c1".into()],
                dtype: "f8".into(),
                shape: vec![3, 3],
                device: "cpu".into(),
            }],
            modules: vec!["numpy".into()],
            on_gpu: false,
        },
    );
    delta.unsavable.insert("g".into(), "generator".into());
    delta.ambient = Some(blob);
    let v1 = CommitV1 {
        session: SESSION,
        base_revision: 4,
        exec_id: EXEC,
        host: "h".into(),
        worker: "w".into(),
        cell_id: "c".into(),
        delta,
    };
    let now: CommitV2 = pinned(&v1, COMMIT_V1);
    assert!(now.uploaded.is_empty());
    assert_eq!(now.delta.objects["o1"].payloads[0].shape, vec![3, 3]);
    assert_eq!(now.delta.variables["x"].global_reads, vec!["y".to_string()]);
    assert_eq!(now.delta.ambient.map(|b| b.len), Some(9));
}
const COMMIT_V1: &str = "100190000000007000800000000000000104100190000000007000800000000000000201680177016301017801026f310001017901036f6c6401026f310901026330000148010263310266380203030363707501056e756d7079000101670967656e657261746f72010901026330";

#[test]
fn session_event_v1_bytes() {
    use session_event_v1::{EventKind, PreparedClass};
    let event = |kind| SessionEventV1 { session: SESSION, exec_id: EXEC, unix_ms: 5, kind };
    let ended = event(EventKind::PreparedEnded {
        host: "h".into(),
        slot: Some(0),
        worker: "w".into(),
        cell_id: "c".into(),
        class: PreparedClass::Speculative,
        idle_ms: 1.5,
        outcome: "evicted for a run".into(),
    });
    let now: SessionEventV2 = pinned(&ended, SESSION_EVENT_V1_ENDED);
    assert!(matches!(now.kind, live::EventKind::PreparedEnded { outcome: PreparedOutcome::EvictedForRun, .. }));
    let released =
        event(EventKind::SlotReleased { host: "h".into(), slot: 1, held_ms: 2.0, reason: "speculation".into() });
    let now: SessionEventV2 = pinned(&released, SESSION_EVENT_V1_RELEASED);
    assert!(matches!(now.kind, live::EventKind::SlotReleased { reason: SlotUse::Speculation, .. }));
    let started = event(EventKind::Started {
        host: "h".into(),
        slot: None,
        worker: "w".into(),
        device: session_event_v1::Device::Gpu,
        prepare: session_event_v1::Prepare::Warm,
        execution_count: 3,
        restored_bytes: 10,
        prepare_ms: 1.0,
        restore_ms: 0.5,
        refreshed: 1,
        import_hit: true,
        python: "3.11.2".into(),
    });
    let now: SessionEventV2 = pinned(&started, SESSION_EVENT_V1_STARTED);
    assert!(matches!(
        now.kind,
        live::EventKind::Started { device: live::Device::Gpu, prepare: live::Prepare::Warm, execution_count: 3, .. }
    ));
}
const SESSION_EVENT_V1_ENDED: &str = "100190000000007000800000000000000110019000000000700080000000000000020507016801000177016300000000000000f83f116576696374656420666f7220612072756e";
const SESSION_EVENT_V1_RELEASED: &str = "10019000000000700080000000000000011001900000000070008000000000000002050801680100000000000000400b73706563756c6174696f6e";
const SESSION_EVENT_V1_STARTED: &str = "10019000000000700080000000000000011001900000000070008000000000000002050201680001770104030a000000000000f03f000000000000e03f010106332e31312e32";

#[test]
fn every_version_1_outcome_string_maps_to_its_enum() {
    let cases = [
        ("used", PreparedOutcome::Used),
        ("superseded", PreparedOutcome::Superseded),
        ("evicted", PreparedOutcome::Evicted),
        ("evicted for a run", PreparedOutcome::EvictedForRun),
        ("session closed", PreparedOutcome::SessionClosed),
        ("lost", PreparedOutcome::Lost),
    ];
    for (s, o) in cases {
        assert_eq!(o.as_str(), s, "the enum spells itself as version 1 did");
        let v1 = SessionEventV1 {
            session: SESSION,
            exec_id: EXEC,
            unix_ms: 0,
            kind: session_event_v1::EventKind::PreparedEnded {
                host: "h".into(),
                slot: None,
                worker: "w".into(),
                cell_id: "c".into(),
                class: session_event_v1::PreparedClass::Warm,
                idle_ms: 0.0,
                outcome: s.into(),
            },
        };
        assert!(matches!(v1.upgrade().kind, live::EventKind::PreparedEnded { outcome, .. } if outcome == o), "{s}");
    }
}

#[test]
fn manifest_v1_bytes() {
    use manifest_v1::{Manifest, Unsavable, VarEntry};
    let blob = commit_v1::Blob { len: 9, chunks: vec!["c0".into()] };
    let object = commit_v1::ObjectEntry {
        record: blob.clone(),
        refs: vec![],
        payloads: vec![],
        modules: vec!["numpy".into()],
        on_gpu: true,
    };
    let var = VarEntry { version: EXEC, oid: Some("o1".into()), module: None, global_reads: vec!["y".into()] };
    let lost = Unsavable {
        version: EXEC,
        reason: "generator".into(),
        host: "h".into(),
        worker: "w".into(),
        cell_id: "c".into(),
    };
    let v1 = ManifestV1 {
        manifest: Manifest {
            session: SESSION,
            revision: 3,
            exec_id: EXEC,
            variables: [("x".to_string(), var)].into(),
            objects: [("o1".to_string(), object)].into(),
            unsavable: [("g".to_string(), lost)].into(),
            ambient: Some(blob),
        },
    };
    let now: live::ManifestV2 = pinned(&v1, MANIFEST_V1);
    let m = now.manifest;
    assert_eq!((m.revision, m.parent, m.forked_from), (3, None, None));
    assert_eq!(m.variables["x"].global_reads, vec!["y".to_string()]);
    assert!(m.objects["o1"].on_gpu);
    assert_eq!(m.unsavable["g"].reason, "generator");
    // version 2 is version 1 with the lineage appended (two absent options)
    let v2 = hex(&encode_bincode(&live::ManifestV2 { manifest: m }).unwrap());
    assert_eq!(v2, format!("{MANIFEST_V1}0000"));
}
const MANIFEST_V1: &str = "1001900000000070008000000000000001031001900000000070008000000000000002010178100190000000007000800000000000000201026f310001017901026f310901026330000001056e756d70790101016710019000000000700080000000000000020967656e657261746f72016801770163010901026330";
