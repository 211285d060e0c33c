//! What the fuzz targets share: the `idem` tool's own parsers (compiled
//! from its files: the tool is a binary, with no library to link), input
//! framing, and the allocation bound every target checks.

// The tool's files, as they are: `ident.rs` names `crate::dialect`, as in
// the tool. What the targets do not call is dead here.
#[allow(dead_code)]
#[path = "../../idempotency-cli/src/dialect.rs"]
pub mod dialect;
#[allow(dead_code)]
#[path = "../../idempotency-cli/src/ident.rs"]
pub mod ident;
#[allow(dead_code)]
#[path = "../../idempotency-cli/src/time.rs"]
pub mod time;

pub mod alloc;

/// The input as lines (`\n` between them; none for an empty input): how
/// the header targets spell several header lines, and readable corpora.
pub fn lines(data: &[u8]) -> Vec<&[u8]> {
    if data.is_empty() { Vec::new() } else { data.split(|&b| b == b'\n').collect() }
}

/// A message a caller may see: no control character, no bidi control (a
/// right-to-left override makes a log line read otherwise than it is).
pub fn is_safe_to_show(text: &str) -> bool {
    text.chars().all(|c| {
        !c.is_control()
            && !matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
}
