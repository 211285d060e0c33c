//! Key templates: literal text plus `<param>` / `<param.field.field>`
//! placeholders, e.g. `"order_<order_id>_pay"` or `"<user>:<req.idem_key>"`.
//!
//! The literal text must already obey the key rule (`[A-Za-z0-9_.:-]`,
//! `idempotency_rules::is_key_char`, the runtime's alphabet): a template that could
//! only ever render invalid keys is a compile error.

use idempotency_rules::is_key_char;

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub pieces: Vec<Piece>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Literal text.
    Text(String),
    /// A parameter and the fields to follow: `["req", "order", "id"]`.
    Param(Vec<String>),
}

impl Template {
    /// The parameters the placeholders start from, in order.
    pub fn roots(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Param(path) => Some(path[0].as_str()),
            Piece::Text(_) => None,
        })
    }
}

/// Parses `text`; the error says what is wrong, for the attribute's span.
pub fn parse_template(text: &str) -> Result<Template, String> {
    if text.is_empty() {
        return Err("the key template is empty".into());
    }
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('<') {
            let close = after.find('>').ok_or_else(|| format!("unclosed placeholder in `{text}`: `<` without `>`"))?;
            let inner = &after[..close];
            if inner.is_empty() {
                return Err("empty placeholder `<>`; write `<param>` or `<param.field>`".into());
            }
            let path: Vec<String> = inner.split('.').map(str::to_owned).collect();
            if let Some(bad) = path.iter().enumerate().find(|(i, seg)| !is_path_segment(seg, *i == 0)).map(|(_, s)| s) {
                return Err(format!(
                    "placeholder `<{inner}>` is not a parameter path: `{bad}` is not an identifier or field"
                ));
            }
            pieces.push(Piece::Param(path));
            rest = &after[close + 1..];
        } else {
            let end = rest.find('<').unwrap_or(rest.len());
            let literal = &rest[..end];
            if let Some(c) = literal.chars().find(|&c| !is_key_char(c)) {
                let hint = if c == '>' { "; placeholders are written `<param>`" } else { "" };
                return Err(format!("character {c:?} cannot appear in a key; keys use A-Z a-z 0-9 _ . : -{hint}"));
            }
            pieces.push(Piece::Text(literal.to_owned()));
            rest = &rest[end..];
        }
    }
    Ok(Template { pieces })
}

/// The root: a parameter name or `self`; after it, a named or tuple field
/// (`order_id`, `0`). Keywords are refused here, so expansion can parse every
/// segment as Rust.
fn is_path_segment(s: &str, root: bool) -> bool {
    if root { s == "self" || syn::parse_str::<syn::Ident>(s).is_ok() } else { syn::parse_str::<syn::Member>(s).is_ok() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(path: &[&str]) -> Piece {
        Piece::Param(path.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn parses_text_and_placeholders() {
        let t = parse_template("order_<order_id>_pay").unwrap();
        assert_eq!(t.pieces, vec![Piece::Text("order_".into()), param(&["order_id"]), Piece::Text("_pay".into())]);
        let t = parse_template("<user>:<req.order.id>").unwrap();
        assert_eq!(t.pieces, vec![param(&["user"]), Piece::Text(":".into()), param(&["req", "order", "id"])]);
        assert_eq!(parse_template("<p.0>").unwrap().pieces, vec![param(&["p", "0"])]);
        assert_eq!(parse_template("<self.id>").unwrap().pieces, vec![param(&["self", "id"])]);
        assert_eq!(parse_template("fixed").unwrap().roots().count(), 0);
    }

    #[test]
    fn rejects_with_a_reason() {
        assert!(parse_template("").unwrap_err().contains("empty"));
        assert!(parse_template("a_<>").unwrap_err().contains("empty placeholder"));
        assert!(parse_template("a_<id").unwrap_err().contains("unclosed"));
        assert!(parse_template("a b<id>").unwrap_err().contains("' '"));
        assert!(parse_template("a_{id}").unwrap_err().contains("'{'"));
        assert!(parse_template("<a-b>").unwrap_err().contains("not a parameter path"));
        assert!(parse_template("<a..b>").unwrap_err().contains("not a parameter path"));
        assert!(parse_template("id>").unwrap_err().contains("placeholders are written"));
        assert!(parse_template("<req.type>").unwrap_err().contains("`type` is not an identifier"));
        assert!(parse_template("<match>").unwrap_err().contains("not a parameter path"));
        assert!(parse_template("<a.self>").unwrap_err().contains("not a parameter path"));
        assert!(parse_template("<_>").unwrap_err().contains("not a parameter path"));
    }
}
