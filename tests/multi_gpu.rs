//! `%%gpu N`: a cell that needs N GPUs gets N slots of one host, together. A host
//! with fewer slots never takes it; a cell asking for more than any host has fails
//! at once, saying so; a malformed placement line is the cell's error.

use looseleaf_client::api::{ExecStatus, StreamItem};
use looseleaf_client::events::{Device, Event, SlotUse};
use looseleaf_test_support::cluster::{bin_dir_of, Services};

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_asking_for_two_gpus_holds_two_slots_of_the_host_that_has_them() -> anyhow::Result<()> {
    let bin = bin_dir_of(env!("CARGO_BIN_EXE_looseleaf"));
    // host-0 has one slot, host-1 two
    let services = Services::start(&bin, &[1, 2], &[]).await?;
    let mut s = services.session(false).await?;

    // several runs: whatever the placement scores, the one-slot host never takes it
    for i in 0..3 {
        let code = "%%gpu 2\nx = 6 * 7\nprint(x)";
        let exec = s.fe.run(s.sid, &format!("c{i}"), code).await?.exec_id;
        assert_eq!(s.events.claimed_by(exec).await?, 1, "run {i} went to the one-slot host");
        let (status, error) = s.events.outcome(exec).await?;
        assert_eq!(status, ExecStatus::Ok, "run {i}: {error:?}");
        assert!(s.events.text(exec).contains("42"), "run {i}: {}", s.events.text(exec));
        let planned = s.events.seen.iter().find_map(|item| match item {
            StreamItem::Event { exec_id, event: Event::Planned { device, device_reason, .. }, .. }
                if *exec_id == exec =>
            {
                Some((*device, device_reason.clone()))
            }
            _ => None,
        });
        assert_eq!(planned, Some((Device::Gpu, "override %%gpu 2".to_string())));
        // both of host-1's slots were held for the cell, and each one's time counted
        let released = |seen: &[StreamItem]| {
            seen.iter()
                .filter_map(|item| match item {
                    StreamItem::Event {
                        event: Event::SlotReleased { host, slot, reason: SlotUse::Cell, .. }, ..
                    } => Some((host.clone(), *slot)),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        while released(&s.events.seen).len() < 2 * (i + 1) {
            s.events.until(|item| matches!(item, StreamItem::Event { event: Event::SlotReleased { .. }, .. })).await?;
        }
        let mut slots = released(&s.events.seen);
        slots.sort();
        slots.dedup();
        assert_eq!(slots, vec![("host-1".to_string(), 0), ("host-1".to_string(), 1)]);
    }

    // one GPU still runs anywhere
    let (status, error, text) = s.run("one", "%%gpu\nprint('one gpu')").await?;
    assert_eq!((status, error), (ExecStatus::Ok, None));
    assert!(text.contains("one gpu"));

    // more than any host has: a clear error at once, not the claim timeout
    let started = std::time::Instant::now();
    let (status, error, _) = s.run("three", "%%gpu 3\nx = 0").await?;
    assert_eq!(status, ExecStatus::Failed);
    let error = error.unwrap_or_default();
    assert!(error.contains("asks for 3 GPUs") && error.contains("largest running gpu-host has 2"), "{error}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "failed only at the claim timeout");

    // a malformed placement line is the cell's own error (as on a plain kernel)
    // and runs nothing
    let (status, _, text) = s.run("bad", "%%gpu two\nx = 0").await?;
    assert_eq!(status, ExecStatus::Error);
    assert!(text.contains("%%gpu N (N >= 1 GPUs on one host)"), "{text}");
    let (_, _, text) = s.run("check", "print(x)").await?;
    assert!(text.contains("42"), "x changed: {text}");
    Ok(())
}
