//! Reading and writing nbformat v4 notebooks as JSON values, so that everything the
//! notebook holds (metadata, markdown, attachments, unknown fields) survives untouched.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::Value;

/// A code cell to run: its position in `cells`, id and source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeCell {
    /// Index in the notebook's `cells`.
    pub index: usize,
    /// The cell's `id`, or `cell-{index}`.
    pub cell_id: String,
    /// The source, joined.
    pub source: String,
}

/// Parse a notebook, checking it is nbformat 4.
pub fn parse(text: &str) -> anyhow::Result<Value> {
    let nb: Value = serde_json::from_str(text).context("while parsing the notebook JSON")?;
    match nb.get("nbformat").and_then(Value::as_u64) {
        Some(4) => {}
        other => bail!("only nbformat 4 notebooks are supported (nbformat is {other:?})"),
    }
    if !nb.get("cells").is_some_and(Value::is_array) {
        bail!("the notebook has no cells array");
    }
    Ok(nb)
}

/// Check every cell is a cell (a type and a source) and give cells without an
/// `id` one, as nbformat 4.5 requires and nbclient does: the id is the LooseLeaf
/// cell id, so edits and runs of one cell line up.
pub fn prepare(nb: &mut Value) -> anyhow::Result<()> {
    let cells = nb.get_mut("cells").and_then(Value::as_array_mut).context("the notebook has no cells array")?;
    let mut added = false;
    let mut seen = std::collections::HashSet::new();
    for (i, cell) in cells.iter_mut().enumerate() {
        let Some(c) = cell.as_object_mut() else { bail!("cell {i} is not an object") };
        match c.get("cell_type").and_then(Value::as_str) {
            Some("code" | "markdown" | "raw") => {}
            other => bail!("cell {i} has cell_type {other:?}; nbformat 4 has code, markdown and raw"),
        }
        if !matches!(c.get("source"), Some(Value::String(_) | Value::Array(_))) {
            bail!("cell {i} has no source");
        }
        let id = c.get("id").and_then(Value::as_str).map(str::to_owned);
        match id {
            Some(id) if seen.insert(id.clone()) => {}
            _ => {
                // nbformat's own form: 8 hex digits of a uuid4
                let mut fresh = uuid::Uuid::new_v4().simple().to_string();
                fresh.truncate(8);
                seen.insert(fresh.clone());
                c.insert("id".into(), Value::String(fresh));
                added = true;
            }
        }
    }
    if added && nb.get("nbformat_minor").and_then(Value::as_u64).is_none_or(|m| m < 5) {
        nb["nbformat_minor"] = Value::from(5);
    }
    Ok(())
}

/// Set `metadata.language_info` to the Python that ran the cells (a kernel's
/// kernel_info gives the same), keeping what the notebook had otherwise.
pub fn set_language_info(nb: &mut Value, python_version: &str) {
    let info = serde_json::json!({
        "name": "python",
        "version": python_version,
        "mimetype": "text/x-python",
        "file_extension": ".py",
        "codemirror_mode": {"name": "ipython", "version": 3},
        "pygments_lexer": "ipython3",
        "nbconvert_exporter": "python",
    });
    if !nb.get("metadata").is_some_and(Value::is_object) {
        nb["metadata"] = serde_json::json!({});
    }
    nb["metadata"]["language_info"] = info;
}

/// Read a notebook file.
pub fn load(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("while reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

fn source_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(lines)) => lines.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    }
}

/// The code cells with non-blank source, in order (blank cells are not executed,
/// as in nbclient).
pub fn code_cells(nb: &Value) -> Vec<CodeCell> {
    let cells = nb.get("cells").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    cells
        .iter()
        .enumerate()
        .filter(|(_, c)| c.get("cell_type").and_then(Value::as_str) == Some("code"))
        .map(|(index, c)| CodeCell {
            index,
            cell_id: c.get("id").and_then(Value::as_str).map_or_else(|| format!("cell-{index}"), String::from),
            source: source_text(c.get("source")),
        })
        .filter(|c| !c.source.trim().is_empty())
        .collect()
}

/// Put an execution's outputs and count into the cell at `index`; an
/// `execute_result` without a count gets the cell's.
pub fn set_outputs(
    nb: &mut Value,
    index: usize,
    mut outputs: Vec<Value>,
    execution_count: Option<u32>,
) -> anyhow::Result<()> {
    let cell = nb
        .get_mut("cells")
        .and_then(Value::as_array_mut)
        .and_then(|cells| cells.get_mut(index))
        .and_then(Value::as_object_mut)
        .with_context(|| format!("notebook has no cell {index}"))?;
    let count = execution_count.map_or(Value::Null, Value::from);
    for out in &mut outputs {
        if let Some(o) = out.as_object_mut() {
            if o.get("output_type").and_then(Value::as_str) == Some("execute_result")
                && o.get("execution_count").is_none_or(Value::is_null)
            {
                o.insert("execution_count".into(), count.clone());
            }
        }
    }
    cell.insert("outputs".into(), Value::Array(outputs));
    cell.insert("execution_count".into(), count);
    Ok(())
}

/// An nbformat error output for a failure outside the cell (no host, worker lost).
pub fn error_output(ename: &str, evalue: &str) -> Value {
    serde_json::json!({ "output_type": "error", "ename": ename, "evalue": evalue, "traceback": [format!("{ename}: {evalue}")] })
}

/// Serialize as nbformat does (one-space indent, trailing newline).
pub fn to_string(nb: &Value) -> anyhow::Result<String> {
    use serde::Serialize;
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, serde_json::ser::PrettyFormatter::with_indent(b" "));
    nb.serialize(&mut ser).context("while serializing the notebook")?;
    let mut s = String::from_utf8(buf).context("notebook JSON is not UTF-8")?;
    s.push('\n');
    Ok(s)
}

/// Write a notebook file: whole or not at all (a temporary file renamed over it),
/// so an interrupted run never leaves half a notebook.
pub fn save(path: &Path, nb: &Value) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".looseleaf-tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, to_string(nb)?).with_context(|| format!("while writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("while writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NB: &str = r##"{
 "cells": [
  {"cell_type": "markdown", "id": "md1", "metadata": {"tags": ["intro"]}, "source": ["# Title\n", "text"]},
  {"cell_type": "code", "id": "c1", "metadata": {}, "source": ["x = 1\n", "x"], "outputs": [], "execution_count": null},
  {"cell_type": "code", "metadata": {}, "source": "   \n", "outputs": [], "execution_count": null},
  {"cell_type": "code", "metadata": {"collapsed": true}, "source": "print(x)", "outputs": [], "execution_count": null}
 ],
 "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
 "nbformat": 4,
 "nbformat_minor": 5
}"##;

    #[test]
    fn code_cells_use_ids_or_positions_and_skip_blank_ones() -> anyhow::Result<()> {
        let nb = parse(NB)?;
        let cells = code_cells(&nb);
        assert_eq!(
            cells,
            vec![
                CodeCell { index: 1, cell_id: "c1".into(), source: "x = 1\nx".into() },
                CodeCell { index: 3, cell_id: "cell-3".into(), source: "print(x)".into() },
            ]
        );
        Ok(())
    }

    #[test]
    fn outputs_and_counts_land_in_their_cells_and_markdown_is_untouched() -> anyhow::Result<()> {
        let mut nb = parse(NB)?;
        let before = nb.clone();
        let result = serde_json::json!({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}});
        set_outputs(&mut nb, 1, vec![result], Some(1))?;
        let stream = serde_json::json!({"output_type": "stream", "name": "stdout", "text": "1\n"});
        set_outputs(&mut nb, 3, vec![stream.clone()], Some(2))?;
        let back = parse(&to_string(&nb)?)?;
        assert_eq!(back["cells"][0], before["cells"][0]);
        assert_eq!(back["cells"][2], before["cells"][2]);
        assert_eq!(back["metadata"], before["metadata"]);
        assert_eq!(back["nbformat_minor"], 5);
        assert_eq!(back["cells"][1]["execution_count"], 1);
        assert_eq!(back["cells"][1]["outputs"][0]["execution_count"], 1);
        assert_eq!(back["cells"][1]["source"], before["cells"][1]["source"]);
        assert_eq!(back["cells"][3]["execution_count"], 2);
        assert_eq!(back["cells"][3]["outputs"], serde_json::json!([stream]));
        assert_eq!(back["cells"][3]["metadata"], serde_json::json!({"collapsed": true}));
        assert!(set_outputs(&mut nb, 9, vec![], None).is_err());
        Ok(())
    }

    #[test]
    fn cells_without_ids_get_unique_ones_and_bad_cells_are_named() -> anyhow::Result<()> {
        let mut nb = parse(NB)?;
        nb["nbformat_minor"] = 4.into();
        nb["cells"][0]["id"] = "c1".into(); // a duplicate is replaced too
        prepare(&mut nb)?;
        let ids: Vec<&str> = nb["cells"].as_array().into_iter().flatten().filter_map(|c| c["id"].as_str()).collect();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 4, "{ids:?}");
        assert_eq!(ids[0], "c1", "the first of two equal ids stays");
        assert_eq!(nb["nbformat_minor"], 5);
        set_language_info(&mut nb, "3.11.7");
        assert_eq!(nb["metadata"]["language_info"]["version"], "3.11.7");
        assert_eq!(nb["metadata"]["kernelspec"]["name"], "python3");

        let mut bad = parse(NB)?;
        bad["cells"][2]["cell_type"] = "heading".into();
        let err = prepare(&mut bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("cell 2") && err.contains("heading"), "{err}");
        Ok(())
    }

    #[test]
    fn non_v4_notebooks_are_refused() {
        assert!(parse(r#"{"nbformat": 3, "cells": []}"#).is_err());
        assert!(parse("not json").is_err());
    }

    /// Any JSON value as a cell: cells of every shape.
    fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z_ ]{0,8}".prop_map(Value::from),
            prop_oneof![Just("code"), Just("markdown"), Just("raw"), Just("id"), Just("source")].prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map(
                    prop_oneof![Just("cell_type"), Just("source"), Just("id"), Just("outputs"), Just("metadata")]
                        .prop_map(String::from),
                    inner,
                    0..5
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// What `looseleaf run` does with a notebook it read, short of running it.
    fn read_like_run(text: &str) {
        let Ok(mut nb) = parse(text) else { return };
        if prepare(&mut nb).is_err() {
            return;
        }
        for cell in code_cells(&nb) {
            let _ = set_outputs(&mut nb, cell.index, vec![error_output("E", "v")], Some(1));
        }
        set_language_info(&mut nb, "3.11.7");
        let _ = to_string(&nb);
    }

    proptest::proptest! {
        /// The notebook reader never panics: on a valid notebook changed anywhere,
        /// cut short, or with cells of any shape, it reads it or says what is wrong.
        #[test]
        fn the_notebook_reader_never_panics(
            at in proptest::prelude::any::<proptest::sample::Index>(),
            with in proptest::prelude::any::<char>(),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            cells in proptest::collection::vec(any_json(), 0..5),
        ) {
            let mut chars: Vec<char> = NB.chars().collect();
            let i = at.index(chars.len());
            chars[i] = with;
            let changed: String = chars.iter().collect();
            read_like_run(&changed);
            read_like_run(&changed[..changed.char_indices().nth(cut.index(chars.len())).map_or(0, |(b, _)| b)]);
            let shaped = serde_json::json!({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4});
            read_like_run(&shaped.to_string());
        }
    }
}
