//! Text from requests, the database or Redis, made safe for the
//! operator's terminal. A `biz_no`, a business column's value, a stored
//! response, a Redis key a `SCAN` found, an error quoting any of them: each
//! can hold a newline that forges a row, `ESC ] 52` that writes the
//! clipboard, `ESC [2K` that erases a line, or a bidi override that makes a
//! line read otherwise than it is. Every such character is written as an
//! escape instead, so what the terminal shows is what the value holds.

use std::borrow::Cow;
use std::fmt::Write;

/// A character never written to a terminal as is: a control (C0, DEL, C1)
/// or an invisible format character, among them the ones that reorder
/// text (bidi embeddings, overrides, isolates and marks), zero-width
/// characters, line and paragraph separators, and tag characters (which
/// can carry hidden ASCII).
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'
                | '\u{061c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// A value as text: each unsafe character as Rust writes it in a string
/// (`\n`, `\r`, `\t`, else `\u{1b}`), and a backslash doubled, so an escape
/// seen is always one the value did not hold as typed.
pub fn text(value: &str) -> Cow<'_, str> {
    escaped(value, true)
}

/// A whole line already made of escaped values (see [`crate::out`]): any
/// unsafe character left is escaped as [`text`] does, backslashes are
/// left alone (the values' own were doubled already).
pub fn line(line: &str) -> Cow<'_, str> {
    escaped(line, false)
}

fn escaped(value: &str, backslash: bool) -> Cow<'_, str> {
    if !value.chars().any(|c| is_unsafe(c) || (backslash && c == '\\')) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 16);
    for c in value.chars() {
        match c {
            '\\' if backslash => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_unsafe(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// JSON text (a stored response, a line of `--json` output): each unsafe
/// character as a JSON escape (`\u001b`; a surrogate pair above U+FFFF).
/// In valid JSON such characters stand only inside strings, where the
/// escape means the same character: the JSON stays valid and its value
/// the same.
pub fn json(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_unsafe(c) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A stored response: as JSON ([`json`]) when it is JSON, as it always is
/// when an engine wrote it; as text ([`text`]) otherwise.
pub fn response(response: &str) -> Cow<'_, str> {
    if serde_json::from_str::<serde::de::IgnoredAny>(response).is_ok() { json(response) } else { text(response) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_invisible_format_characters_are_escaped() {
        assert_eq!(text("order_4"), Cow::Borrowed("order_4"));
        assert_eq!(text("4\n6  forged"), "4\\n6  forged");
        assert_eq!(text("\u{1b}]52;c;aGk=\u{7}"), "\\u{1b}]52;c;aGk=\\u{7}");
        assert_eq!(text("\u{1b}[2Kx\r"), "\\u{1b}[2Kx\\r");
        assert_eq!(text("a\tb\u{7f}\u{9b}\u{85}"), "a\\tb\\u{7f}\\u{9b}\\u{85}");
        assert_eq!(text("\u{202e}cba\u{202c}"), "\\u{202e}cba\\u{202c}");
        for c in ['\u{202a}', '\u{202d}', '\u{2066}', '\u{2069}', '\u{200e}', '\u{200f}', '\u{61c}', '\u{200b}'] {
            assert_eq!(text(&format!("x{c}")), format!("x\\u{{{:x}}}", u32::from(c)));
        }
        assert_eq!(text("\u{e0041}"), "\\u{e0041}", "a tag character");
        // A backslash is doubled, so `\n` seen is a newline, `\\n` the two characters.
        assert_eq!(text("a\\nb"), "a\\\\nb");
        // Visible text beyond ASCII stays as it is.
        assert_eq!(text("caf\u{e9} \u{4e2d}\u{1f4b8}"), Cow::Borrowed("caf\u{e9} \u{4e2d}\u{1f4b8}"));
        assert_eq!(line("a\\\\b\u{1b}"), "a\\\\b\\u{1b}");
    }

    #[test]
    fn json_stays_json_with_the_same_value() {
        let value = serde_json::json!({ "no": "4\n\u{1b}[2K\u{7f}\u{9b}\u{202e}\u{2066}\u{e0041}\\\"" });
        let compact = serde_json::to_string(&value).unwrap();
        let shown = json(&compact);
        assert!(!shown.chars().any(is_unsafe), "{shown}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&shown).unwrap(), value);
        assert_eq!(
            shown, "{\"no\":\"4\\n\\u001b[2K\\u007f\\u009b\\u202e\\u2066\\udb40\\udc41\\\\\\\"\"}",
            "serde_json's own escapes stay; the rest become \\u escapes"
        );
        assert_eq!(response(&compact), shown);
        assert_eq!(response("not json \u{1b}\\"), "not json \\u{1b}\\\\");
    }
}
