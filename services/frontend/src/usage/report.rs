//! A usage report: day entries grouped by user, notebook, session or day, and
//! the same rows as CSV.

use std::collections::BTreeMap;

use looseleaf_client::usage::{UsageBy, UsageRow};
use uuid::Uuid;

use super::{DayUsage, Spent};

/// `entries` grouped `by`, largest GPU use first.
pub fn report(entries: &[DayUsage], by: UsageBy) -> Vec<UsageRow> {
    type Group = (Option<String>, Option<String>, Option<String>, Option<Uuid>);
    let mut groups: BTreeMap<Group, Spent> = BTreeMap::new();
    for u in entries {
        let group = match by {
            UsageBy::User => (None, u.owner.clone(), None, None),
            UsageBy::Notebook => (None, u.owner.clone(), u.notebook.clone(), None),
            UsageBy::Session => (None, u.owner.clone(), u.notebook.clone(), Some(u.session_id)),
            UsageBy::Day => (Some(u.day.clone()), u.owner.clone(), None, None),
        };
        groups.entry(group).or_default().add(&u.spent);
    }
    let mut rows: Vec<UsageRow> = groups
        .into_iter()
        .map(|((day, user, notebook, session_id), spent)| UsageRow {
            day,
            user,
            notebook,
            session_id,
            gpu_seconds: spent.gpu_ms / 1000.0,
            cpu_seconds: spent.cpu_ms / 1000.0,
            cells: spent.cells,
            gpu_cells: spent.gpu_cells,
        })
        .collect();
    if by != UsageBy::Day {
        rows.sort_by(|a, b| b.gpu_seconds.total_cmp(&a.gpu_seconds));
    }
    rows
}

/// `rows` as CSV (RFC 4180), with the columns that name a group `by` first.
pub fn csv(rows: &[UsageRow], by: UsageBy) -> String {
    let names: &[&str] = match by {
        UsageBy::User => &["user"],
        UsageBy::Notebook => &["user", "notebook"],
        UsageBy::Session => &["user", "notebook", "session_id"],
        UsageBy::Day => &["day", "user"],
    };
    let field = |s: &str| {
        // a spreadsheet would take a name starting so for a formula
        let s = if s.starts_with(['=', '+', '-', '@']) { format!("'{s}") } else { s.to_string() };
        if s.contains([',', '"', '\n', '\r']) {
            format!("\"{}\"", s.replace('"', "\"\""))
        } else {
            s
        }
    };
    let mut out = names.join(",") + ",gpu_seconds,cpu_seconds,cells,gpu_cells\r\n";
    for r in rows {
        let session = r.session_id.map(|s| s.to_string());
        let named: Vec<String> = names
            .iter()
            .map(|n| match *n {
                "day" => r.day.as_deref(),
                "user" => r.user.as_deref(),
                "notebook" => r.notebook.as_deref(),
                _ => session.as_deref(),
            })
            .map(|v| field(v.unwrap_or_default()))
            .collect();
        out +=
            &format!("{},{:.3},{:.3},{},{}\r\n", named.join(","), r.gpu_seconds, r.cpu_seconds, r.cells, r.gpu_cells);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::super::USAGE_VERSION;
    use super::*;

    fn used(day: &str, owner: &str, notebook: &str, session_id: Uuid, gpu_ms: f64, cells: u64) -> DayUsage {
        DayUsage {
            version: USAGE_VERSION,
            day: day.into(),
            session_id,
            owner: Some(owner.into()),
            notebook: Some(notebook.into()),
            spent: Spent { gpu_ms, cpu_ms: 500.0, cells, gpu_cells: cells / 2 },
            counted: VecDeque::new(),
        }
    }

    #[test]
    fn reports_sum_each_group_and_csv_quotes_what_needs_it() {
        let (s1, s2, s3) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let entries = [
            used("2026-12-05", "ada", "a.ipynb", s1, 1000.0, 2),
            used("2026-12-06", "ada", "a.ipynb", s1, 3000.0, 4),
            used("2026-12-06", "ada", "b, \"the\" one.ipynb", s2, 500.0, 1),
            used("2026-12-06", "bob", "a.ipynb", s3, 8000.0, 6),
            used("2026-12-06", "bob", "=HYPERLINK(1).ipynb", Uuid::now_v7(), 0.0, 1),
        ];
        let by_user = report(&entries, UsageBy::User);
        assert_eq!(by_user.len(), 2);
        assert_eq!((by_user[0].user.as_deref(), by_user[0].gpu_seconds), (Some("bob"), 8.0), "largest first");
        assert_eq!((by_user[1].gpu_seconds, by_user[1].cpu_seconds, by_user[1].cells), (4.5, 1.5, 7));
        let by_notebook = report(&entries, UsageBy::Notebook);
        assert_eq!(by_notebook.len(), 4, "ada's two notebooks and bob's two");
        let by_session = report(&entries, UsageBy::Session);
        assert_eq!(by_session.iter().find(|r| r.session_id == Some(s1)).map(|r| r.cells), Some(6));
        let by_day = report(&entries, UsageBy::Day);
        let days: Vec<_> = by_day.iter().map(|r| (r.day.clone().unwrap(), r.user.clone().unwrap())).collect();
        assert_eq!(
            days,
            [
                ("2026-12-05".into(), "ada".into()),
                ("2026-12-06".into(), "ada".into()),
                ("2026-12-06".into(), "bob".into())
            ]
        );

        let text = csv(&by_notebook, UsageBy::Notebook);
        let lines: Vec<&str> = text.split("\r\n").collect();
        assert_eq!(lines[0], "user,notebook,gpu_seconds,cpu_seconds,cells,gpu_cells");
        assert_eq!(lines[1], "bob,a.ipynb,8.000,0.500,6,3");
        assert!(lines.contains(&"ada,\"b, \"\"the\"\" one.ipynb\",0.500,0.500,1,0"), "{text}");
        assert!(lines.contains(&"bob,'=HYPERLINK(1).ipynb,0.000,0.500,1,0"), "no formula: {text}");
    }
}
