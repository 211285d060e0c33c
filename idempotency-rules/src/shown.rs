//! How a character a caller sent may appear in a message.

use std::fmt;

/// A character as it may appear in a message, a log line or an HTTP
/// problem: visible ASCII quoted (`':'`), anything else only as its code
/// point (`U+000A`, `U+00E9`), so a message never carries control bytes,
/// bidi overrides or look-alikes from what a caller sent. The quote itself
/// (`'`) shows as `U+0027`, so a quoted character is never ambiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown(pub char);

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            ch @ ('!'..='&' | '('..='~') => write!(f, "'{ch}'"),
            ch => write!(f, "U+{:04X}", u32::from(ch)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Shown;

    #[test]
    fn visible_ascii_is_quoted_the_rest_is_a_code_point() {
        assert_eq!(Shown(':').to_string(), "':'");
        assert_eq!(Shown('~').to_string(), "'~'");
        assert_eq!(Shown(' ').to_string(), "U+0020");
        assert_eq!(Shown('\'').to_string(), "U+0027");
        assert_eq!(Shown('\t').to_string(), "U+0009");
        assert_eq!(Shown('é').to_string(), "U+00E9");
        assert_eq!(Shown('\u{1F600}').to_string(), "U+1F600");
    }
}
