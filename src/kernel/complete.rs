//! `is_complete_request`: whether a console should run the code the user typed or
//! wait for more lines (as IPython answers it), from the same parser the planner
//! uses, so the kernel answers without a worker.

use ruff_python_parser::{parse_unchecked, LexicalErrorType, Mode, ParseErrorType, ParseOptions};

/// `("complete" | "incomplete" | "invalid", indent)` for `code`.
pub fn is_complete(code: &str) -> (&'static str, String) {
    // ruff 0.0.10 can panic on some malformed IPython input: that input is invalid
    let Ok(parsed) = std::panic::catch_unwind(|| parse_unchecked(code, ParseOptions::from(Mode::Ipython))) else {
        return ("invalid", String::new());
    };
    let end = code.trim_end().len();
    let mut invalid = false;
    for e in parsed.errors() {
        let at_end = usize::from(e.location.start()) >= end;
        let open =
            matches!(e.error, ParseErrorType::Lexical(LexicalErrorType::UnclosedStringError | LexicalErrorType::Eof));
        if at_end || open {
            // an unclosed bracket, string or block: more lines will come
            return ("incomplete", indent_after(code));
        }
        invalid = true;
    }
    if invalid {
        return ("invalid", String::new());
    }
    // a block (its last line indented) goes on until a blank line, as in IPython
    let last = code.lines().last().unwrap_or_default();
    if !code.ends_with("\n\n") && last.starts_with([' ', '\t']) && !last.trim().is_empty() {
        return ("incomplete", indent_after(code));
    }
    ("complete", String::new())
}

/// The indent of the next line: the last line's, one level more after a `:`.
fn indent_after(code: &str) -> String {
    let last = code.lines().last().unwrap_or_default();
    let indent: String = last.chars().take_while(|c| *c == ' ' || *c == '\t').collect();
    if last.trim_end().ends_with(':') {
        indent + "    "
    } else {
        indent
    }
}

#[cfg(test)]
mod tests {
    use super::is_complete;

    #[test]
    fn complete_incomplete_and_invalid_code_is_told_apart_as_ipython_does() {
        for code in ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n", "%time x = 1", "!ls"] {
            assert_eq!(is_complete(code).0, "complete", "{code:?}");
        }
        for (code, indent) in
            [("print('''hello", ""), ("def f(x):\n  x*2", "  "), ("for i in range(3):", "    "), ("x = [1,", "")]
        {
            assert_eq!(is_complete(code), ("incomplete", indent.to_string()), "{code:?}");
        }
        for code in ["import = 7q", "1 +* 2\nx = 3"] {
            assert_eq!(is_complete(code).0, "invalid", "{code:?}");
        }
    }
}
