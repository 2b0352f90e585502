//! Quotas (issue 40, ADR 66): per user, GPU-seconds per UTC day and GPU cells
//! at once, from a file the operator writes (`--quota-file`), read again when it
//! changes. A GPU cell over its user's quota fails before it takes a slot, saying
//! what was used, the limit and when it resets; CPU cells still run.
//!
//! The file has one line per user, `*` for everyone a line does not name:
//!
//! ```text
//! # user   limits (either may be left out: no limit)
//! *        gpu_seconds_per_day=3600  concurrent_gpu_cells=1
//! alice    gpu_seconds_per_day=36000
//! ```
//!
//! A user's line sets the limits it names; the others are `*`'s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::usage::{next_day_ms, Spent};

/// How often the quota file is read again to see whether it changed.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The user a quota line names for everyone else.
const EVERYONE: &str = "*";

/// One user's limits (None: no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limit {
    /// GPU-slot seconds per UTC day.
    pub gpu_seconds_per_day: Option<f64>,
    /// GPU cells running at once.
    pub concurrent_gpu_cells: Option<usize>,
}

impl Limit {
    fn or(self, fallback: Limit) -> Limit {
        Limit {
            gpu_seconds_per_day: self.gpu_seconds_per_day.or(fallback.gpu_seconds_per_day),
            concurrent_gpu_cells: self.concurrent_gpu_cells.or(fallback.concurrent_gpu_cells),
        }
    }
}

/// Why a quota file was refused.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    /// It could not be read.
    #[error("cannot read the quota file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not `USER KEY=VALUE ...` with known keys and numbers.
    #[error("quota file line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// The quotas a file sets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuotaTable {
    everyone: Limit,
    users: HashMap<String, Limit>,
}

impl QuotaTable {
    /// The quotas of a quota file's text.
    pub fn parse(text: &str) -> Result<Self, QuotaError> {
        let mut table = QuotaTable::default();
        let mut seen = std::collections::HashSet::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| QuotaError::Line { line: i + 1, reason };
            let mut words = line.split_whitespace();
            let user = words.next().unwrap_or_default();
            if !seen.insert(user.to_string()) {
                return Err(bad(format!("{user:?} has a line already")));
            }
            let mut limit = Limit::default();
            for word in words {
                let Some((key, value)) = word.split_once('=') else {
                    return Err(bad(format!("{word:?} is not KEY=VALUE")));
                };
                match key {
                    "gpu_seconds_per_day" => match value.parse::<f64>() {
                        Ok(v) if v.is_finite() && v >= 0.0 => limit.gpu_seconds_per_day = Some(v),
                        _ => return Err(bad(format!("gpu_seconds_per_day={value:?} is not a number of seconds"))),
                    },
                    "concurrent_gpu_cells" => match value.parse::<usize>() {
                        Ok(v) => limit.concurrent_gpu_cells = Some(v),
                        Err(_) => return Err(bad(format!("concurrent_gpu_cells={value:?} is not a whole number"))),
                    },
                    other => {
                        return Err(bad(format!(
                            "unknown key {other:?} (the keys are gpu_seconds_per_day and concurrent_gpu_cells)"
                        )))
                    }
                }
            }
            if user == EVERYONE {
                table.everyone = limit;
            } else {
                table.users.insert(user.to_string(), limit);
            }
        }
        Ok(table)
    }

    /// `user`'s limits (None: the open API's one user, whom `*` binds).
    pub fn limit_of(&self, user: Option<&str>) -> Limit {
        let own = user.and_then(|u| self.users.get(u)).copied().unwrap_or_default();
        own.or(self.everyone)
    }
}

/// The quotas in force, shared; the file's path, to read it again.
#[derive(Clone, Debug, Default)]
pub struct Quotas {
    table: Arc<RwLock<Arc<QuotaTable>>>,
    path: Option<PathBuf>,
    /// The text the quotas in force were read from.
    text: Option<String>,
}

impl Quotas {
    /// No quota at all.
    pub fn none() -> Self {
        Self::default()
    }

    /// The quotas `path` sets, or why it is refused.
    pub fn load(path: &Path) -> Result<Self, QuotaError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| QuotaError::Read { path: path.display().to_string(), source })?;
        let table = QuotaTable::parse(&text)?;
        Ok(Self { table: Arc::new(RwLock::new(Arc::new(table))), path: Some(path.to_path_buf()), text: Some(text) })
    }

    /// The quotas now.
    pub fn current(&self) -> Arc<QuotaTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Read the file again every [`RELOAD_EVERY`] until `stop`; a change takes
    /// effect at once; a file that became unreadable or malformed leaves the
    /// quotas as they were, and the error is logged (once per change).
    pub async fn follow(self, stop: tokio_util::sync::CancellationToken) {
        let Some(path) = self.path.clone() else { return };
        let mut last_text = self.text.clone();
        while tokio::time::timeout(RELOAD_EVERY, stop.cancelled()).await.is_err() {
            let text = std::fs::read_to_string(&path).ok();
            if text == last_text {
                continue;
            }
            last_text = text.clone();
            let parsed = match text {
                Some(text) => QuotaTable::parse(&text),
                None => Err(QuotaError::Read {
                    path: path.display().to_string(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "it is gone or unreadable"),
                }),
            };
            match parsed {
                Ok(table) => {
                    *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
                    tracing::info!(file = %path.display(), "quotas read again");
                }
                Err(e) => {
                    tracing::error!(error = %e, "the quota file changed and is refused; the quotas stay as they were")
                }
            }
        }
    }
}

/// The start of every quota refusal (a cell's error, as its user reads it).
pub const REFUSED: &str = "GPU quota reached";

/// Why `user` may not have a GPU now, if so: `today` is what they used this UTC
/// day, `running` how many GPU cells they run (or may run) elsewhere.
pub fn gpu_refusal(limit: Limit, user: Option<&str>, today: &Spent, running: usize, now_ms: u64) -> Option<String> {
    let who = user.unwrap_or("this user");
    if let Some(most) = limit.gpu_seconds_per_day {
        let used = today.gpu_ms / 1000.0;
        if used >= most {
            let resets = next_day_ms(now_ms);
            let at = std::time::UNIX_EPOCH + Duration::from_millis(resets);
            let within = humantime::format_duration(Duration::from_secs(resets.saturating_sub(now_ms) / 60_000 * 60));
            return Some(format!(
                "{REFUSED}: {who} used {} of {most} GPU-seconds today (UTC); it resets at {} (in {within}). \
                 CPU cells still run.",
                seconds(used),
                humantime::format_rfc3339_seconds(at)
            ));
        }
    }
    if let Some(most) = limit.concurrent_gpu_cells {
        if running >= most {
            return Some(format!(
                "{REFUSED}: {who} runs {running} GPU cells at once, and may run {most}; it resets when one of them \
                 ends. CPU cells still run."
            ));
        }
    }
    None
}

/// Seconds as a person reads them: small ones to the millisecond.
fn seconds(s: f64) -> String {
    match s {
        s if s < 1.0 => format!("{s:.3}"),
        s if s < 100.0 => format!("{s:.1}"),
        s => format!("{s:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_line_overrides_everyones_key_by_key_and_bad_lines_are_named() {
        let t = QuotaTable::parse(
            "# limits\n*  gpu_seconds_per_day=3600 concurrent_gpu_cells=1\nalice gpu_seconds_per_day=36000 # more\nbob\n",
        )
        .unwrap();
        assert_eq!(
            t.limit_of(Some("alice")),
            Limit { gpu_seconds_per_day: Some(36000.0), concurrent_gpu_cells: Some(1) }
        );
        assert_eq!(t.limit_of(Some("bob")), t.limit_of(Some("carol")), "a line without keys is everyone's");
        assert_eq!(t.limit_of(None).gpu_seconds_per_day, Some(3600.0), "the open API's user too");
        assert_eq!(QuotaTable::parse("").unwrap().limit_of(Some("x")), Limit::default());
        for (text, says) in [
            ("* gpu_seconds=5\n", "line 1: unknown key \"gpu_seconds\""),
            ("*\nalice concurrent_gpu_cells=-1\n", "line 2: concurrent_gpu_cells=\"-1\""),
            ("alice gpu_seconds_per_day=lots\n", "not a number"),
            ("alice 5\n", "not KEY=VALUE"),
            ("alice\nalice\n", "line 2: \"alice\" has a line already"),
        ] {
            let err = QuotaTable::parse(text).unwrap_err().to_string();
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }

    #[test]
    fn a_refusal_says_what_was_used_the_limit_and_when_it_resets() {
        let limit = Limit { gpu_seconds_per_day: Some(60.0), concurrent_gpu_cells: Some(2) };
        let noon = crate::usage::day_start_ms("2026-12-06").unwrap() + 12 * 3600 * 1000;
        let spent = |s: f64| Spent { gpu_ms: s * 1000.0, ..Spent::default() };
        assert_eq!(gpu_refusal(limit, Some("ada"), &spent(59.9), 1, noon), None);
        let day = gpu_refusal(limit, Some("ada"), &spent(61.25), 0, noon).unwrap();
        assert!(day.starts_with(REFUSED), "{day}");
        assert!(day.contains("ada used 61.2 of 60 GPU-seconds today"), "{day}");
        assert!(day.contains("resets at 2026-12-07T00:00:00Z (in 12h)"), "{day}");
        assert!(day.contains("CPU cells still run"), "{day}");
        let many = gpu_refusal(limit, Some("ada"), &spent(0.0), 2, noon).unwrap();
        assert!(many.contains("runs 2 GPU cells at once, and may run 2"), "{many}");
        let tiny = Limit { gpu_seconds_per_day: Some(0.001), concurrent_gpu_cells: None };
        let small = gpu_refusal(tiny, Some("ada"), &spent(0.0153), 0, noon).unwrap();
        assert!(small.contains("ada used 0.015 of 0.001 GPU-seconds"), "{small}");
        assert_eq!(gpu_refusal(Limit::default(), None, &spent(1e9), 99, noon), None, "no limit, no refusal");
    }
}
