//! A cell's output messages, applied to the notebook as nbclient applies them, so
//! that `looseleaf run` writes what nbclient would write:
//! - `clear_output` empties the cell's outputs; with `wait`, only when the next
//!   output arrives (a progress loop keeps just its last line);
//! - an output with a `transient.display_id` is remembered under that id, and an
//!   `update_display_data`, or another display with the same id, replaces the data
//!   and metadata of every output remembered under it, in any cell;
//!
//! Only notebook outputs come here (`CellMessage::Output`): a side channel (the
//! pager's text, a comm message, an input request) is never a notebook's.
//!
//! `transient` never reaches the notebook (nbformat has no such field).

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

/// Outputs of the cells run so far, and where each display id is shown.
#[derive(Debug, Default)]
pub struct NotebookOutputs {
    cells: BTreeMap<usize, Vec<Value>>,
    /// display id -> (cell index, output index) of each output shown under it.
    display_ids: HashMap<String, Vec<(usize, usize)>>,
}

fn display_id(msg: &Value) -> Option<String> {
    msg.get("transient")?.get("display_id")?.as_str().map(str::to_owned)
}

impl NotebookOutputs {
    /// Apply one execution's messages, in order, to the cell at `index`.
    pub fn apply(&mut self, index: usize, messages: Vec<Value>) {
        self.clear(index);
        let mut clear_before_next = false;
        for mut msg in messages {
            let kind = msg.get("output_type").and_then(Value::as_str).unwrap_or("").to_owned();
            let id = display_id(&msg);
            if let Some(id) = &id {
                if matches!(kind.as_str(), "display_data" | "execute_result" | "update_display_data") {
                    self.update(id, &msg);
                }
            }
            match kind.as_str() {
                "clear_output" => {
                    if msg.get("wait").and_then(Value::as_bool).unwrap_or(false) {
                        clear_before_next = true;
                    } else {
                        self.clear(index);
                    }
                }
                // it changed the outputs shown under its display id (above)
                "update_display_data" => {}
                _ => {
                    if clear_before_next {
                        self.clear(index);
                        clear_before_next = false;
                    }
                    if let Some(o) = msg.as_object_mut() {
                        o.remove("transient");
                    }
                    let outs = self.cells.entry(index).or_default();
                    if let Some(id) = id {
                        self.display_ids.entry(id).or_default().push((index, outs.len()));
                    }
                    outs.push(msg);
                }
            }
        }
    }

    /// The outputs of the cell at `index` (empty if it has none).
    pub fn cell(&self, index: usize) -> Vec<Value> {
        self.cells.get(&index).cloned().unwrap_or_default()
    }

    fn clear(&mut self, index: usize) {
        self.cells.insert(index, Vec::new());
        for shown in self.display_ids.values_mut() {
            shown.retain(|(c, _)| *c != index);
        }
    }

    fn update(&mut self, id: &str, msg: &Value) {
        let Some(shown) = self.display_ids.get(id) else { return };
        for (c, i) in shown {
            if let Some(out) = self.cells.get_mut(c).and_then(|outs| outs.get_mut(*i)).and_then(Value::as_object_mut) {
                for key in ["data", "metadata"] {
                    out.insert(key.into(), msg.get(key).cloned().unwrap_or_else(|| serde_json::json!({})));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stream(text: &str) -> Value {
        json!({"output_type": "stream", "name": "stdout", "text": text})
    }

    fn display(text: &str, id: Option<&str>) -> Value {
        let mut d = json!({"output_type": "display_data", "data": {"text/plain": text}, "metadata": {}});
        if let Some(id) = id {
            d["transient"] = json!({"display_id": id});
        }
        d
    }

    #[test]
    fn clear_output_with_wait_keeps_only_what_follows_the_last_clear() {
        let mut nb = NotebookOutputs::default();
        let wait = json!({"output_type": "clear_output", "wait": true});
        nb.apply(
            0,
            vec![stream("epoch 1\n"), wait.clone(), stream("epoch 2\n"), wait.clone(), stream("epoch 3\n"), wait],
        );
        // the last clear waits for an output that never comes
        assert_eq!(nb.cell(0), vec![stream("epoch 3\n")]);
        let now = json!({"output_type": "clear_output", "wait": false});
        nb.apply(1, vec![stream("a\n"), now, stream("b\n")]);
        assert_eq!(nb.cell(1), vec![stream("b\n")]);
    }

    #[test]
    fn updates_replace_every_output_shown_under_the_id_in_any_cell() {
        let mut nb = NotebookOutputs::default();
        nb.apply(0, vec![display("not started", Some("s"))]);
        nb.apply(1, vec![display("other", None), display("again", Some("s"))]);
        let mut update = display("done", Some("s"));
        update["output_type"] = json!("update_display_data");
        nb.apply(2, vec![update, stream("x\n")]);
        assert_eq!(nb.cell(0), vec![display("done", None)]);
        assert_eq!(nb.cell(1), vec![display("other", None), display("done", None)]);
        assert_eq!(nb.cell(2), vec![stream("x\n")]);
    }

    #[test]
    fn a_cleared_output_is_no_longer_updated() {
        let mut nb = NotebookOutputs::default();
        let clear = json!({"output_type": "clear_output", "wait": false});
        let mut update = display("new", Some("p"));
        update["output_type"] = json!("update_display_data");
        nb.apply(0, vec![display("old", Some("p")), clear, stream("after\n"), update]);
        assert_eq!(nb.cell(0), vec![stream("after\n")]);
    }
}
