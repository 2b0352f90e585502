//! A cell's `input()` and `getpass()`: the worker asks, the run's client answers.
//!
//! The worker sends `input_request` and waits. The host registers a wait for the
//! execution, then asks the client through the cell's outputs (an
//! `input_request` output: the frontend passes it to a client with a stdin
//! channel, and refuses at once for one without, as ipykernel does). The answer
//! comes back on `session.{sid}.input` to every host; the one waiting on that
//! execution hands it to its worker. A user who interrupts instead gets a
//! KeyboardInterrupt in the cell.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use schemas::messages::InputReplyV1;
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::interrupts::Interrupts;
use crate::protocol::Frame;

/// How often a wait for input checks whether the user interrupted the cell.
const INTERRUPT_POLL: Duration = Duration::from_millis(100);

/// The executions of this host that wait for a line from their client.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    waits: Arc<Mutex<HashMap<Uuid, oneshot::Sender<InputReplyV1>>>>,
}

impl Inputs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, oneshot::Sender<InputReplyV1>>> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Execution `exec` is about to ask its client: the answer is kept for the
    /// returned wait, however soon it comes.
    pub fn expect(&self, exec: Uuid) -> InputWait {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(exec, tx);
        InputWait { exec, rx, inputs: self.clone() }
    }

    /// An answer from the bus: handed to the execution waiting on it here;
    /// dropped if none is (another host runs it, or the cell was interrupted).
    pub fn deliver(&self, reply: InputReplyV1) {
        let waiting = self.lock().remove(&reply.exec_id);
        if let Some(tx) = waiting {
            let _ = tx.send(reply);
        }
    }
}

/// One execution's wait for its client's answer.
#[derive(Debug)]
pub struct InputWait {
    exec: Uuid,
    rx: oneshot::Receiver<InputReplyV1>,
    inputs: Inputs,
}

impl InputWait {
    /// The frame that answers the worker: the client's line, or the interrupt
    /// the user sent instead. No time limit of its own: a user may take long to
    /// type, and the cell timeout and the interrupt end a wait nobody answers.
    pub async fn answer(mut self, interrupts: &Interrupts) -> Frame {
        let exec_id = self.exec.to_string();
        loop {
            tokio::select! {
                reply = &mut self.rx => {
                    return match reply {
                        Ok(r) => Frame::InputReply { exec_id, value: r.value, refused: r.refused, interrupted: false },
                        // the sender went without answering: only when the host stops
                        Err(_) => Frame::InputReply {
                            exec_id,
                            value: String::new(),
                            refused: Some("the host stopped while the cell waited for input.".into()),
                            interrupted: false,
                        },
                    };
                }
                _ = tokio::time::sleep(INTERRUPT_POLL) => {
                    if interrupts.asked(self.exec) {
                        return Frame::InputReply { exec_id, value: String::new(), refused: None, interrupted: true };
                    }
                }
            }
        }
    }
}

impl Drop for InputWait {
    fn drop(&mut self) {
        self.inputs.lock().remove(&self.exec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(exec_id: Uuid, value: &str) -> InputReplyV1 {
        InputReplyV1 { session: Uuid::nil(), exec_id, value: value.into(), refused: None }
    }

    #[tokio::test]
    async fn an_answer_reaches_the_execution_that_waits_and_no_other() {
        let inputs = Inputs::default();
        let interrupts = Interrupts::new(Duration::from_secs(5));
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let wait = inputs.expect(a);
        inputs.deliver(reply(b, "not yours")); // another host's execution: dropped
        inputs.deliver(reply(a, "Ada"));
        match wait.answer(&interrupts).await {
            Frame::InputReply { value, refused, interrupted, .. } => {
                assert_eq!((value.as_str(), refused, interrupted), ("Ada", None, false))
            }
            other => panic!("{other:?}"),
        }
        assert!(inputs.lock().is_empty(), "an answered wait is forgotten");
    }

    #[tokio::test]
    async fn an_interrupt_ends_the_wait() {
        let inputs = Inputs::default();
        let interrupts = Interrupts::new(Duration::from_secs(5));
        let exec = Uuid::now_v7();
        let wait = inputs.expect(exec);
        interrupts.ask(exec);
        match wait.answer(&interrupts).await {
            Frame::InputReply { interrupted, .. } => assert!(interrupted),
            other => panic!("{other:?}"),
        }
        assert!(inputs.lock().is_empty(), "an interrupted wait is forgotten");
        inputs.deliver(reply(exec, "late")); // too late: dropped, never a panic
    }
}
