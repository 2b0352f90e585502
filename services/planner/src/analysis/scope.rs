//! The scope-aware walk: Python's name binding rules over ruff's AST.
//!
//! Module and class bodies are analyzed flow-sensitively (a read counts only if no binding
//! definitely precedes it on every path); function, lambda and comprehension scopes are
//! resolved statically, as CPython does: a name is local if bound anywhere in the scope.
//! Free names of a nested scope bubble up to the nearest enclosing function scope that
//! binds them; class scopes do not enclose their methods or comprehensions.

use std::collections::{HashMap, HashSet};

use ruff_text_size::TextSize;

use super::builtins::is_builtin;
use super::CellAnalysis;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FrameKind {
    Module,
    Class,
    Function,
    Comprehension,
}

/// A change to a flow-sensitive frame's set of definitely bound names, kept while inside
/// a branch so the branch can be undone and merged.
enum LogEntry {
    Add(String),
    Remove(String),
}

/// The net effect of one branch on the definitely-bound set.
#[derive(Default)]
pub(super) struct Delta {
    added: HashSet<String>,
    removed: HashSet<String>,
}

pub(super) struct Frame {
    pub(super) kind: FrameKind,
    /// Module/class: names definitely bound at the current point.
    pub(super) bound: HashSet<String>,
    /// Undo log of `bound`, only kept while `depth > 0`.
    log: Vec<LogEntry>,
    depth: usize,
    /// Function/comprehension: every name bound anywhere in the scope (its locals).
    pub(super) ever: HashSet<String>,
    /// Function/comprehension: names loaded, resolved when the frame is popped.
    /// Class: names loaded before a binding in the class body (free at that point).
    pub(super) loads: HashSet<String>,
    /// Class: free names of nested scopes, which skip the class.
    pub(super) passthrough: HashSet<String>,
    pub(super) global_decl: HashSet<String>,
    pub(super) nonlocal_decl: HashSet<String>,
    pub(super) global_reads: HashSet<String>,
    pub(super) global_writes: HashSet<String>,
    /// Dynamic namespace access in this scope or one nested in it (what, where).
    pub(super) dynamic: Option<String>,
    /// `eval`/`exec` in this scope or one nested in it.
    pub(super) evals: bool,
}

impl Frame {
    pub(super) fn new(kind: FrameKind) -> Self {
        Frame {
            kind,
            bound: HashSet::new(),
            log: Vec::new(),
            depth: 0,
            ever: HashSet::new(),
            loads: HashSet::new(),
            passthrough: HashSet::new(),
            global_decl: HashSet::new(),
            nonlocal_decl: HashSet::new(),
            global_reads: HashSet::new(),
            global_writes: HashSet::new(),
            dynamic: None,
            evals: false,
        }
    }

    pub(super) fn add_bound(&mut self, name: &str) {
        if self.bound.contains(name) {
            return;
        }
        self.bound.insert(name.to_owned());
        if self.depth > 0 {
            self.log.push(LogEntry::Add(name.to_owned()));
        }
    }

    pub(super) fn remove_bound(&mut self, name: &str) {
        if self.bound.remove(name) && self.depth > 0 {
            self.log.push(LogEntry::Remove(name.to_owned()));
        }
    }
}

/// What a popped scope leaves for its parent.
pub(super) struct ScopeResult {
    /// Names the scope reads but does not bind (to resolve in enclosing scopes).
    pub(super) free: HashSet<String>,
    /// The subset of `free` evaluated right away (comprehensions, class bodies).
    pub(super) now: HashSet<String>,
    pub(super) global_reads: HashSet<String>,
    pub(super) global_writes: HashSet<String>,
    /// The scope's kind, and its dynamic namespace access (see `Frame::dynamic`).
    pub(super) kind: FrameKind,
    pub(super) dynamic: Option<String>,
    pub(super) evals: bool,
}

pub(super) struct Analyzer<'s> {
    /// The whole cell, for line numbers.
    src: &'s str,
    /// Offset of the text being walked within `src`.
    pub(super) base: usize,
    /// Set while walking text parsed out of a magic or shell line: every line is that one.
    pub(super) fixed_line: Option<usize>,
    pub(super) frames: Vec<Frame>,
    pub(super) out: CellAnalysis,
    pub(super) future_annotations: bool,
    /// Names bound to the `cupy` module (or its members) in this cell.
    pub(super) cupy_aliases: HashSet<String>,
}

impl<'s> Analyzer<'s> {
    pub(super) fn new(src: &'s str) -> Self {
        Analyzer {
            src,
            base: 0,
            fixed_line: None,
            frames: vec![Frame::new(FrameKind::Module)],
            out: CellAnalysis::default(),
            future_annotations: false,
            cupy_aliases: HashSet::new(),
        }
    }

    /// 1-based line of an offset into the text being walked.
    pub(super) fn line_of(&self, at: TextSize) -> usize {
        if let Some(line) = self.fixed_line {
            return line;
        }
        let end = (self.base + at.to_usize()).min(self.src.len());
        1 + self.src.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count()
    }

    pub(super) fn conservative(&mut self, what: &str, at: TextSize) {
        if self.out.conservative.is_none() {
            let line = self.line_of(at);
            self.out.conservative = Some(format!("{what} at line {line}"));
        }
    }

    /// Names reached by a computed string (`eval(s)`, `globals()`): at top level the
    /// cell's closure cannot be known; inside a def, the definition says so in its
    /// summary and cells that use it restore conservatively.
    pub(super) fn dynamic(&mut self, what: &str, at: TextSize) {
        if self.at_module() {
            self.conservative(what, at);
            return;
        }
        let line = self.line_of(at);
        if let Some(f) = self.frames.last_mut() {
            if f.dynamic.is_none() {
                f.dynamic = Some(format!("{what} at line {line}"));
            }
        }
    }

    /// `eval`/`exec` of a string: at top level like any dynamic access; inside a
    /// definition the worker's safety net brings in what it reaches, so the
    /// definition only says it evaluates (`DefSummary::evals`).
    pub(super) fn evaluates(&mut self, what: &str, at: TextSize) {
        if self.at_module() {
            self.conservative(what, at);
        } else if let Some(f) = self.frames.last_mut() {
            f.evals = true;
        }
    }

    pub(super) fn kind(&self) -> FrameKind {
        self.frames.last().map_or(FrameKind::Module, |f| f.kind)
    }

    pub(super) fn at_module(&self) -> bool {
        self.kind() == FrameKind::Module
    }

    // ---- bindings and loads -------------------------------------------------------------

    pub(super) fn load(&mut self, name: &str) {
        // Error recovery produces empty names for missing expressions.
        if name.is_empty() {
            return;
        }
        let Some(f) = self.frames.last_mut() else {
            return;
        };
        if f.kind != FrameKind::Module && f.global_decl.contains(name) {
            if !f.global_reads.contains(name) {
                f.global_reads.insert(name.to_owned());
            }
            return;
        }
        match f.kind {
            FrameKind::Module => {
                let builtin = is_builtin(name);
                if !builtin && !self.out.calls.contains(name) {
                    self.out.calls.insert(name.to_owned());
                }
                if !f.bound.contains(name) {
                    let set = if builtin { &mut self.out.builtin_reads } else { &mut self.out.reads };
                    if !set.contains(name) {
                        set.insert(name.to_owned());
                    }
                }
            }
            FrameKind::Class => {
                if !f.bound.contains(name) && !f.loads.contains(name) {
                    f.loads.insert(name.to_owned());
                }
            }
            FrameKind::Function | FrameKind::Comprehension => {
                if !f.loads.contains(name) {
                    f.loads.insert(name.to_owned());
                }
            }
        }
    }

    pub(super) fn bind(&mut self, name: &str) {
        if name.is_empty() {
            return;
        }
        let Some(f) = self.frames.last_mut() else {
            return;
        };
        if f.kind != FrameKind::Module && f.global_decl.contains(name) {
            if !f.global_writes.contains(name) {
                f.global_writes.insert(name.to_owned());
            }
            return;
        }
        if f.nonlocal_decl.contains(name) {
            return;
        }
        match f.kind {
            FrameKind::Module => {
                if !self.out.writes.contains(name) {
                    self.out.writes.insert(name.to_owned());
                }
                f.add_bound(name);
            }
            FrameKind::Class => f.add_bound(name),
            FrameKind::Function | FrameKind::Comprehension => {
                if !f.ever.contains(name) {
                    f.ever.insert(name.to_owned());
                }
            }
        }
    }

    /// `del name`, or the end of an `except ... as name` handler.
    pub(super) fn unbind(&mut self, name: &str) {
        if name.is_empty() {
            return;
        }
        let Some(f) = self.frames.last_mut() else {
            return;
        };
        if f.kind != FrameKind::Module && f.global_decl.contains(name) {
            f.global_writes.insert(name.to_owned());
            return;
        }
        match f.kind {
            FrameKind::Module => {
                f.remove_bound(name);
                self.out.deletes.insert(name.to_owned());
            }
            FrameKind::Class => f.remove_bound(name),
            FrameKind::Function | FrameKind::Comprehension => {
                f.ever.insert(name.to_owned());
            }
        }
    }

    /// A walrus target: binds in the nearest enclosing non-comprehension scope.
    pub(super) fn bind_walrus(&mut self, name: &str) {
        if name.is_empty() {
            return;
        }
        if self.kind() != FrameKind::Comprehension {
            self.bind(name);
            return;
        }
        let Some(f) = self.frames.iter_mut().rev().find(|f| f.kind != FrameKind::Comprehension) else {
            return;
        };
        match f.kind {
            // The comprehension may run zero times: a possible write, not a definite one.
            FrameKind::Module => {
                self.out.writes.insert(name.to_owned());
            }
            FrameKind::Function if f.global_decl.contains(name) => {
                f.global_writes.insert(name.to_owned());
            }
            FrameKind::Function if !f.nonlocal_decl.contains(name) => {
                f.ever.insert(name.to_owned());
            }
            _ => {}
        }
    }

    // ---- scopes -------------------------------------------------------------------------

    pub(super) fn push(&mut self, kind: FrameKind) {
        self.frames.push(Frame::new(kind));
    }

    pub(super) fn pop(&mut self) -> ScopeResult {
        let Some(f) = self.frames.pop() else {
            return ScopeResult {
                free: HashSet::new(),
                now: HashSet::new(),
                global_reads: HashSet::new(),
                global_writes: HashSet::new(),
                kind: FrameKind::Module,
                dynamic: None,
                evals: false,
            };
        };
        let (free, now) = match f.kind {
            FrameKind::Class => {
                let now = f.loads.clone();
                let mut free = f.loads;
                free.extend(f.passthrough);
                (free, now)
            }
            FrameKind::Comprehension => {
                let free: HashSet<String> = f.loads.into_iter().filter(|n| !f.ever.contains(n)).collect();
                (free.clone(), free)
            }
            _ => {
                let free = f.loads.into_iter().filter(|n| !f.ever.contains(n)).collect();
                (free, HashSet::new())
            }
        };
        ScopeResult {
            free,
            now,
            global_reads: f.global_reads,
            global_writes: f.global_writes,
            kind: f.kind,
            dynamic: f.dynamic,
            evals: f.evals,
        }
    }

    /// Hands a popped scope's free names to the (new) current scope. `own_name` (the name a
    /// def is about to bind) is not a cell read: the body can only run once it is bound.
    pub(super) fn absorb(&mut self, r: ScopeResult, own_name: Option<&str>) {
        let Some(f) = self.frames.last_mut() else {
            return;
        };
        if f.kind != FrameKind::Module {
            if f.dynamic.is_none() {
                f.dynamic.clone_from(&r.dynamic);
            }
            f.evals |= r.evals;
        }
        match f.kind {
            FrameKind::Module => {
                // a comprehension runs now; a def's or lambda's body only when called
                if r.kind == FrameKind::Comprehension && self.out.conservative.is_none() {
                    self.out.conservative.clone_from(&r.dynamic);
                }
                for n in &r.now {
                    if !is_builtin(n) && !self.out.calls.contains(n.as_str()) {
                        self.out.calls.insert(n.clone());
                    }
                }
                for n in r.free.into_iter().chain(r.global_reads) {
                    if Some(n.as_str()) == own_name || f.bound.contains(&n) {
                        continue;
                    }
                    if is_builtin(&n) {
                        self.out.builtin_reads.insert(n);
                    } else {
                        self.out.reads.insert(n);
                    }
                }
            }
            FrameKind::Class => {
                f.passthrough.extend(r.free);
                f.global_reads.extend(r.global_reads);
                f.global_writes.extend(r.global_writes);
            }
            FrameKind::Function | FrameKind::Comprehension => {
                for n in r.free {
                    if f.global_decl.contains(&n) {
                        f.global_reads.insert(n);
                    } else {
                        f.loads.insert(n);
                    }
                }
                f.global_reads.extend(r.global_reads);
                f.global_writes.extend(r.global_writes);
            }
        }
    }

    // ---- branches -----------------------------------------------------------------------

    pub(super) fn mark(&mut self) -> usize {
        match self.frames.last_mut() {
            Some(f) => {
                f.depth += 1;
                f.log.len()
            }
            None => 0,
        }
    }

    /// Undoes the current frame's binding changes since `mark` and returns them.
    pub(super) fn unwind(&mut self, mark: usize) -> Delta {
        let mut delta = Delta::default();
        let Some(f) = self.frames.last_mut() else {
            return delta;
        };
        f.depth = f.depth.saturating_sub(1);
        if mark >= f.log.len() {
            return delta;
        }
        let mut was_bound: HashMap<String, bool> = HashMap::new();
        for entry in f.log.drain(mark..) {
            match entry {
                LogEntry::Add(n) => was_bound.entry(n).or_insert(false),
                LogEntry::Remove(n) => was_bound.entry(n).or_insert(true),
            };
        }
        for (n, was) in was_bound {
            let now = f.bound.contains(&n);
            if now && !was {
                f.bound.remove(&n);
                delta.added.insert(n);
            } else if !now && was {
                f.bound.insert(n.clone());
                delta.removed.insert(n);
            }
        }
        delta
    }

    /// Applies the merge of alternative branches. `exhaustive`: one of them always runs.
    pub(super) fn merge(&mut self, deltas: Vec<Delta>, exhaustive: bool) {
        let Some(f) = self.frames.last_mut() else {
            return;
        };
        let mut iter = deltas.into_iter();
        let Some(first) = iter.next() else { return };
        let mut added = if exhaustive { first.added } else { HashSet::new() };
        let mut removed = first.removed;
        for d in iter {
            added.retain(|n| d.added.contains(n));
            removed.extend(d.removed);
        }
        for n in &removed {
            f.remove_bound(n);
        }
        for n in &added {
            f.add_bound(n);
        }
    }

    /// Runs `walk` as a branch that may or may not execute.
    pub(super) fn maybe<F: FnOnce(&mut Self)>(&mut self, walk: F) {
        let m = self.mark();
        walk(self);
        let d = self.unwind(m);
        self.merge(vec![d], false);
    }
}
