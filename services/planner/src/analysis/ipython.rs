//! IPython syntax: cell magics (handled before parsing), line magics, shell escapes with
//! `{expr}` / `$var` interpolation, `obj?` help, and LooseLeaf's `%%gpu` / `%%cpu`.

use ruff_python_ast::visitor::Visitor;
use ruff_python_ast::{IpyEscapeKind, Mod, Stmt};
use ruff_python_parser::{parse_expression, parse_unchecked, Mode, ParseOptions, Parsed};
use ruff_text_size::TextSize;

use super::scope::{Analyzer, FrameKind};
use super::{CellAnalysis, Device, DeviceHint};

/// Cell magics whose body is Python run in the session namespace.
const PYTHON_CELL_MAGICS: &[&str] = &["time", "capture", "prun", "debug"];

/// Line magics that read or rewrite the namespace in ways we cannot see.
const DYNAMIC_MAGICS: &[&str] =
    &["load", "macro", "recall", "rerun", "reset", "reset_selective", "run", "store", "who", "who_ls", "whos", "xdel"];

/// Line magics whose arguments never refer to session variables.
const INERT_MAGICS: &[&str] =
    &["aimport", "autoreload", "conda", "config", "env", "load_ext", "matplotlib", "pip", "reload_ext", "unload_ext"];

/// IPython's own magics whose words are not session variables (paths, settings,
/// shell commands); `{expr}` and `$var` in them still interpolate. Any other magic
/// may be one the notebook registered: see `Analyzer::magic_reads`.
const OWN_MAGICS: &[&str] = &[
    "alias",
    "autocall",
    "automagic",
    "bash",
    "bookmark",
    "cd",
    "colors",
    "dhist",
    "doctest_mode",
    "file",
    "hist",
    "history",
    "html",
    "javascript",
    "js",
    "latex",
    "logoff",
    "logon",
    "logstart",
    "logstate",
    "logstop",
    "ls",
    "lsmagic",
    "magic",
    "markdown",
    "perl",
    "popd",
    "precision",
    "pushd",
    "pwd",
    "pypy",
    "python",
    "python2",
    "python3",
    "quickref",
    "rehashx",
    "ruby",
    "script",
    "sh",
    "svg",
    "sx",
    "system",
    "unalias",
    "writefile",
    "xmode",
];

/// LooseLeaf's placement override on a cell's first line: `%%gpu` (one slot),
/// `%%gpu N` (N slots on one host, N >= 1) or `%%cpu`; None for anything else
/// after the magic's name.
fn placement(name: &str, args: &str) -> Option<DeviceHint> {
    let args = args.trim();
    let (label, gpus) = match (name, args) {
        ("gpu", "") => (Device::Gpu, 1),
        ("gpu", n) => (Device::Gpu, n.parse::<u32>().ok().filter(|n| *n >= 1)?),
        ("cpu", "") => (Device::Cpu, 0),
        _ => return None,
    };
    let reason = if args.is_empty() { format!("override %%{name}") } else { format!("override %%{name} {args}") };
    Some(DeviceHint { label, reason, gpus })
}

/// Entry point behind [`super::analyze`].
pub(super) fn analyze_cell(code: &str) -> CellAnalysis {
    let mut a = Analyzer::new(code);
    let mut start = 0;
    // `%%gpu`/`%%cpu` must be the first line; another cell magic may follow it.
    let mut first = true;
    let mut timeit = false;
    loop {
        let rest = &code[start..];
        let line_end = rest.find('\n').map_or(rest.len(), |i| i + 1);
        let line = rest[..line_end].trim_end();
        let Some(magic) = line.strip_prefix("%%") else {
            break;
        };
        let mut words = magic.split_whitespace();
        let name = words.next().unwrap_or("");
        match name {
            "gpu" | "cpu" if first => {
                let Some(hint) = placement(name, words_after(magic, name)) else {
                    // `%%gpu two`: not a placement; the worker's `%%gpu` magic says
                    // what is wrong, as it does in a plain kernel
                    return a.out;
                };
                a.out.device = Some(hint);
                start += line_end;
                first = false;
                continue;
            }
            "timeit" => {
                // `%%timeit [-opts] [setup]`: the body runs inside a function.
                timeit = true;
                a.push(FrameKind::Function);
                let setup = strip_options(words_after(magic, name), "n:r:p:tcqo");
                if !setup.trim().is_empty() {
                    a.fixed_line = Some(a.line_of(TextSize::from(start as u32)));
                    a.walk_source(setup);
                    a.fixed_line = None;
                }
            }
            "capture" => {
                let args = words_after(magic, name);
                if let Some(var) = args.split_whitespace().find(|w| !w.starts_with('-')) {
                    a.bind(var);
                }
            }
            n if PYTHON_CELL_MAGICS.contains(&n) => {}
            // %%bash, %%sh, %%html, %%javascript, %%latex, %%markdown, %%writefile, %%svg,
            // and any unknown cell magic: the body is not Python. A magic the notebook
            // registered is a variable of the session (the decorated function), and
            // its arguments may name variables it reads.
            n => {
                let args = words_after(magic, n);
                a.magic_reads(n, args);
                // and such a magic often binds the name it is given (`%%hparams cfg`,
                // as `%%capture out` does): a possible write, harmless if it does not
                if !OWN_MAGICS.contains(&n) {
                    for word in args.split_whitespace().filter(|w| is_identifier(w)) {
                        a.bind(word);
                    }
                }
                return a.out;
            }
        }
        start += line_end;
        break;
    }
    let body = &code[start..];
    a.base = start;
    let (parsed, recovered) = match parse_cell(body) {
        Some(parsed) => (parsed, false),
        None => match parse_guarded(body, Mode::Module) {
            Some(parsed) => (parsed, true),
            None => {
                a.out.conservative = Some("parse error at line 1: parser failure".to_owned());
                a.out.syntax_error = true;
                return a.out;
            }
        },
    };
    if recovered && parsed.errors().is_empty() {
        a.out.conservative = Some("parse error at line 1: IPython parser failure".to_owned());
    }
    if let Some(err) = parsed.errors().first() {
        // An error at end of input belongs to the last line, not the empty one after it.
        let at = err.location.start().min(TextSize::from(body.trim_end().len() as u32));
        let line = a.line_of(at);
        a.out.conservative = Some(format!("parse error at line {line}: {}", err.error));
        // an error of the plain-Python parse after IPython's parser gave up may
        // be IPython syntax it lacks, not text typed halfway
        a.out.syntax_error = !recovered;
    }
    let Mod::Module(module) = parsed.syntax() else {
        if timeit {
            a.pop();
        }
        return a.out;
    };
    a.future_annotations = module.body.iter().any(is_future_annotations);
    if timeit {
        a.body(&module.body);
        let r = a.pop();
        a.absorb(r, None);
    } else {
        a.body(&module.body);
    }
    a.out
}

/// Parses in IPython mode. ruff 0.0.10 can panic (an `unreachable!`) on some malformed
/// IPython input, such as `[)'\n,`; such input is a parse error, so the panic is contained
/// and reported as `None`.
fn parse_cell(source: &str) -> Option<Parsed<Mod>> {
    parse_guarded(source, Mode::Ipython)
}

fn parse_guarded(source: &str, mode: Mode) -> Option<Parsed<Mod>> {
    std::panic::catch_unwind(|| parse_unchecked(source, ParseOptions::from(mode))).ok()
}

fn is_future_annotations(s: &Stmt) -> bool {
    matches!(s, Stmt::ImportFrom(i)
        if i.module.as_ref().is_some_and(|m| m.as_str() == "__future__")
            && i.names.iter().any(|n| n.name.as_str() == "annotations"))
}

/// The text of `magic` after its name.
fn words_after<'t>(magic: &'t str, name: &str) -> &'t str {
    let trimmed = magic.trim_start();
    trimmed.strip_prefix(name).unwrap_or(trimmed)
}

/// Skips leading getopt-style options (`spec` as in getopt: a letter followed by `:`
/// takes an argument) and returns the rest of the line.
fn strip_options<'t>(mut text: &'t str, spec: &str) -> &'t str {
    loop {
        let trimmed = text.trim_start();
        let Some(opt) = trimmed.strip_prefix('-') else {
            return trimmed;
        };
        let word_end = opt.find(char::is_whitespace).unwrap_or(opt.len());
        let word = &opt[..word_end];
        let Some(letter) = word.chars().next() else {
            return trimmed;
        };
        if !letter.is_ascii_alphabetic() && letter != '-' {
            return trimmed; // `-x` in Python code
        }
        let takes_arg = spec.find(letter).is_some_and(|i| spec[i + 1..].starts_with(':'));
        text = &opt[word_end..];
        if takes_arg && word.len() == 1 || word.starts_with('-') {
            // `-n 10` or `--breakpoint FILE:LINE`: skip the argument too.
            let after = text.trim_start();
            let arg_end = after.find(char::is_whitespace).unwrap_or(after.len());
            text = &after[arg_end..];
        }
    }
}

/// The leading identifier of `text` (`obj` in `obj.attr?`), if any.
fn leading_identifier(text: &str) -> Option<&str> {
    let end = text
        .char_indices()
        .find(|&(i, c)| !(c == '_' || c.is_alphanumeric()) || (i == 0 && c.is_numeric()))
        .map_or(text.len(), |(i, _)| i);
    (end > 0).then(|| &text[..end])
}

impl Analyzer<'_> {
    /// Walks Python text found inside a magic, in the current scope.
    pub(super) fn walk_source(&mut self, source: &str) {
        let Some(parsed) = parse_cell(source) else {
            return;
        };
        if let Mod::Module(m) = parsed.syntax() {
            self.body(&m.body);
        }
    }

    pub(super) fn escape_command(&mut self, kind: IpyEscapeKind, value: &str, at: TextSize) {
        let line = self.line_of(at);
        let saved = self.fixed_line.replace(line);
        match kind {
            IpyEscapeKind::Shell | IpyEscapeKind::ShCap => self.interpolate(value),
            IpyEscapeKind::Help
            | IpyEscapeKind::Help2
            | IpyEscapeKind::Paren
            | IpyEscapeKind::Quote
            | IpyEscapeKind::Quote2 => {
                if let Some(name) = leading_identifier(value.trim_start()) {
                    self.load(name);
                }
            }
            IpyEscapeKind::Magic => self.line_magic(value, at),
            // A `%%magic` line that is not the cell's first line: IPython rejects it.
            IpyEscapeKind::Magic2 => {}
        }
        self.fixed_line = saved;
    }

    fn line_magic(&mut self, value: &str, at: TextSize) {
        let value = value.trim_start();
        let name_end = value.find(char::is_whitespace).unwrap_or(value.len());
        let (name, args) = value.split_at(name_end);
        match name {
            "time" => self.walk_source(args.trim_start()),
            "prun" => self.walk_source(strip_options(args, "D:T:l:s:rq")),
            "debug" => self.walk_source(strip_options(args, "b:")),
            // %timeit compiles the statement into a function: reads only.
            "timeit" => {
                self.push(FrameKind::Function);
                self.walk_source(strip_options(args, "n:r:p:tcqo"));
                let r = self.pop();
                self.absorb(r, None);
            }
            n if DYNAMIC_MAGICS.contains(&n) => {
                let what = format!("%{n} magic");
                self.conservative(&what, at);
            }
            n if INERT_MAGICS.contains(&n) => {}
            n => {
                self.interpolate(args);
                self.magic_reads(n, args);
            }
        }
    }

    /// A magic of unknown meaning: one the notebook registered is bound to a session
    /// variable of its name (`@register_line_magic def seed(line)`), and such magics
    /// (`%tensorinfo x w`) often look up the variables their arguments name. Both are
    /// reads; they resolve only against names the session defined, so IPython's own
    /// magics cost nothing.
    pub(super) fn magic_reads(&mut self, name: &str, args: &str) {
        if OWN_MAGICS.contains(&name) {
            return;
        }
        if is_identifier(name) {
            self.load(name);
        }
        for word in args.split(|c: char| c.is_whitespace() || c == ',') {
            let head = word.split('.').next().unwrap_or("");
            if is_identifier(head) {
                self.load(head);
            }
        }
    }

    /// Reads in `{expr}` and `$var` / `$var.attr` interpolations of a shell or magic line.
    fn interpolate(&mut self, text: &str) {
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'{' => {
                    let mut depth = 0usize;
                    let mut j = i;
                    while j < bytes.len() {
                        match bytes[j] {
                            b'{' => depth += 1,
                            b'}' => {
                                depth -= 1;
                                if depth == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        j += 1;
                    }
                    if j >= bytes.len() {
                        return;
                    }
                    let inner = &text[i + 1..j];
                    if !inner.starts_with('{') {
                        if let Ok(parsed) = parse_expression(inner) {
                            self.visit_expr(&parsed.syntax().body);
                        }
                    }
                    i = j + 1;
                }
                b'$' if bytes.get(i + 1) == Some(&b'$') => i += 2,
                b'$' => {
                    if let Some(name) = leading_identifier(&text[i + 1..]) {
                        if !name.starts_with(|c: char| c.is_numeric()) {
                            self.load(name);
                        }
                        i += 1 + name.len();
                    } else {
                        i += 1;
                    }
                }
                _ => i += 1,
            }
        }
    }
}

/// A Python identifier (ASCII form; magic arguments are rarely anything else).
fn is_identifier(word: &str) -> bool {
    word.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
        && word.chars().all(|c| c.is_alphanumeric() || c == '_')
}
