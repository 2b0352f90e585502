//! The shell requests that ask about code without running it: completion and
//! inspection (`complete_request`, `inspect_request`), answered by the session's
//! live objects or else inferred from its code, and `history_request`, answered
//! from the kernel's stored executions.

use jupyter_protocol::JupyterMessage;
use looseleaf_client::api::CodeAtCursor;
use serde_json::{json, Value};

use super::Kernel;

/// How many of the session's latest cells completion reads when it infers from
/// the code (no live objects to ask).
const HELP_HISTORY_CELLS: usize = 500;

/// Whether `text` matches the glob `pattern` (`*` any run, `?` one character), as
/// IPython's history search matches. Iterative (a cell may be megabytes long):
/// on a mismatch, the last `*` takes one more character.
fn glob_match(pattern: &[char], text: &[char]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(c) if *c == '?' || *c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|c| *c == '*')
}

impl Kernel {
    /// A completion or inspection, answered by the session's live objects (its
    /// CPU worker, through the frontend); an error reply when that cannot be
    /// asked, never a hang.
    pub(super) async fn query(&mut self, msg: &JupyterMessage) -> Value {
        let raw = serde_json::to_value(&msg.content).unwrap_or_default();
        let code = raw["code"].as_str().unwrap_or_default().to_string();
        let cursor_pos = raw["cursor_pos"].as_u64().unwrap_or(code.chars().count() as u64);
        let detail_level = raw["detail_level"].as_u64().map_or(0, |d| d.min(1) as u8);
        let at = CodeAtCursor { code, cursor_pos, detail_level };
        let opened = self.ensure_session().await;
        let answer = match (&self.session, opened) {
            (None, opened) => Err(format!("no LooseLeaf session: {}", opened.err().unwrap_or_default())),
            (Some(s), _) if msg.message_type() == "complete_request" => {
                s.fe.complete(s.sid, &at).await.map_err(|e| e.to_string())
            }
            (Some(s), _) => s.fe.inspect(s.sid, &at).await.map_err(|e| e.to_string()),
        };
        let answer = answer.unwrap_or_else(
            |why| json!({ "status": "error", "ename": "LooseLeafError", "evalue": why, "traceback": [] }),
        );
        // no live object answered (no CPU worker yet, or every cell serverless):
        // infer from the session's code, as an editor does
        let found_nothing = answer["status"] != "ok"
            || answer["matches"].as_array().is_some_and(Vec::is_empty)
            || answer["found"] == false;
        if !found_nothing {
            return answer;
        }
        let kind = if msg.message_type() == "complete_request" { "complete" } else { "inspect" };
        let skip = self.history.len().saturating_sub(HELP_HISTORY_CELLS);
        let history: Vec<&str> = self.history[skip..].iter().map(|(_, code)| code.as_str()).collect();
        match self.codehelp.ask(kind, &history, &at.code, at.cursor_pos).await {
            Some(inferred) if inferred["status"] == "ok" => inferred,
            _ => answer,
        }
    }

    /// The history a `history_request` asks for (tail, range or search) of this
    /// kernel's stored executions; the session number is 0, the current one.
    pub(super) fn history_entries(&self, request: &Value) -> Vec<Value> {
        let output = request["output"].as_bool().unwrap_or(false);
        fn last(mut entries: Vec<&(u64, String)>, n: Option<u64>) -> Vec<&(u64, String)> {
            let n = n.map_or(entries.len(), |n| usize::try_from(n).unwrap_or(usize::MAX));
            entries.split_off(entries.len().saturating_sub(n))
        }
        let all: Vec<&(u64, String)> = self.history.iter().collect();
        let chosen = match request["hist_access_type"].as_str() {
            Some("tail") => last(all, Some(request["n"].as_u64().unwrap_or(10))),
            Some("range") => {
                let start = request["start"].as_u64().unwrap_or(0);
                let stop = request["stop"].as_u64().filter(|s| *s > 0).unwrap_or(u64::MAX);
                all.into_iter().filter(|(n, _)| *n >= start && *n < stop).collect()
            }
            Some("search") => {
                let pattern: Vec<char> = request["pattern"].as_str().unwrap_or("*").chars().collect();
                let mut found: Vec<&(u64, String)> = all
                    .into_iter()
                    .filter(|(_, code)| glob_match(&pattern, &code.chars().collect::<Vec<_>>()))
                    .collect();
                if request["unique"].as_bool().unwrap_or(false) {
                    // the latest run of each distinct input
                    let mut seen = std::collections::HashSet::new();
                    found.reverse();
                    found.retain(|(_, code)| seen.insert(code.clone()));
                    found.reverse();
                }
                last(found, request["n"].as_u64())
            }
            _ => all,
        };
        chosen
            .into_iter()
            .map(|(n, code)| if output { json!([0, n, [code, ""]]) } else { json!([0, n, code]) })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn history_search_globs_match_as_ipython_does_even_on_huge_cells() {
        let m = |p: &str, t: &str| glob_match(&p.chars().collect::<Vec<_>>(), &t.chars().collect::<Vec<_>>());
        assert!(m("1?2*", "1+2+3") && m("*", "") && m("a*b*c", "aXbYc") && m("??", "ab"));
        assert!(!m("1?2*", "12+3") && !m("a*b", "ac") && !m("?", "") && !m("abc", "ab"));
        let huge = "x".repeat(4 << 20) + "y";
        assert!(m("*y", &huge) && !m("*z*", &huge));
    }
}
