//! Parses `#[idempotent(key = "...", ttl = "...", biz = "...", ...)]`.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::parse::Parser;
use syn::{Expr, LitStr};

use crate::key::{Template, parse_template};
use crate::ttl::parse_duration;

const ARGUMENTS: &str = "`key`, `ttl`, `biz`, `lease`, `biz_no`, `engine`";
/// A Redis claim outlives most bodies by far, and a body outliving it still
/// commits once (the record decides), so a generous default costs nothing.
const DEFAULT_LEASE_MS: u64 = 30_000;

/// The checked arguments.
pub struct Args {
    pub key: (LitStr, Template),
    pub ttl_ms: u64,
    pub biz: LitStr,
    pub lease_ms: u64,
    pub biz_no: Option<(LitStr, Template)>,
    pub engine: Option<Expr>,
}

pub fn parse(tokens: TokenStream) -> syn::Result<Args> {
    let mut key = None;
    let mut ttl = None;
    let mut biz = None;
    let mut lease = None;
    let mut biz_no = None;
    let mut engine = None;

    let parser = syn::meta::parser(|meta| {
        let name = meta.path.get_ident().map(ToString::to_string).unwrap_or_default();
        let taken = match name.as_str() {
            "key" => key.is_some(),
            "ttl" => ttl.is_some(),
            "biz" => biz.is_some(),
            "lease" => lease.is_some(),
            "biz_no" => biz_no.is_some(),
            "engine" => engine.is_some(),
            _ => {
                let shown = meta.path.to_token_stream().to_string().replace(' ', "");
                return Err(meta.error(format!("unknown argument `{shown}`; expected one of {ARGUMENTS}")));
            }
        };
        if taken {
            return Err(meta.error(format!("duplicate argument `{name}`")));
        }
        match name.as_str() {
            "key" => key = Some(template(meta.value()?.parse()?)?),
            "ttl" => ttl = Some(duration(meta.value()?.parse()?, "ttl")?),
            "biz" => biz = Some(biz_name(meta.value()?.parse()?)?),
            "lease" => lease = Some(duration(meta.value()?.parse()?, "lease")?),
            "biz_no" => biz_no = Some(template(meta.value()?.parse()?)?),
            _ => engine = Some(meta.value()?.parse::<Expr>()?),
        }
        Ok(())
    });
    parser.parse2(tokens)?;

    let missing = |what: &str, example: &str| {
        syn::Error::new(
            Span::call_site(),
            format!(
                "missing argument `{what}`, e.g. `#[idempotent(key = \"order_<order_id>_pay\", ttl = \"24h\", biz = \"pay\")]` ({example})"
            ),
        )
    };
    Ok(Args {
        key: key.ok_or_else(|| missing("key", "the key template"))?,
        ttl_ms: ttl.ok_or_else(|| missing("ttl", "how long the record protects the key"))?,
        biz: biz.ok_or_else(|| missing("biz", "the business action"))?,
        lease_ms: lease.unwrap_or(DEFAULT_LEASE_MS),
        biz_no,
        engine,
    })
}

fn template(lit: LitStr) -> syn::Result<(LitStr, Template)> {
    let t = parse_template(&lit.value()).map_err(|m| syn::Error::new_spanned(&lit, m))?;
    Ok((lit, t))
}

fn duration(lit: LitStr, what: &str) -> syn::Result<u64> {
    parse_duration(&lit.value()).map_err(|m| syn::Error::new_spanned(&lit, format!("invalid `{what}`: {m}")))
}

fn biz_name(lit: LitStr) -> syn::Result<LitStr> {
    let v = lit.value();
    let ok =
        (1..=32).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(syn::Error::new_spanned(
            &lit,
            "`biz` must match [a-z0-9_]{1,32}, e.g. \"pay\" or \"order_refund\"",
        ));
    }
    Ok(lit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn err(tokens: TokenStream) -> String {
        match parse(tokens) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_all_arguments() {
        let a = parse(quote!(
            key = "o_<id>",
            ttl = "1h30m",
            biz = "pay",
            lease = "10s",
            biz_no = "<id>",
            engine = self.idem
        ))
        .unwrap();
        assert_eq!(a.ttl_ms, 5_400_000);
        assert_eq!(a.lease_ms, 10_000);
        assert_eq!(a.biz.value(), "pay");
        assert!(a.biz_no.is_some() && a.engine.is_some());
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b")).unwrap();
        assert_eq!(a.lease_ms, DEFAULT_LEASE_MS);
    }

    #[test]
    fn names_the_valid_arguments() {
        assert!(err(quote!(tll = "1h")).contains("unknown argument `tll`; expected one of `key`, `ttl`"));
        assert!(err(quote!(key = "a", key = "b")).contains("duplicate argument `key`"));
        assert!(err(quote!(ttl = "1h", biz = "x")).contains("missing argument `key`"));
        assert!(err(quote!(key = "a", biz = "x")).contains("missing argument `ttl`"));
        assert!(err(quote!(key = "a", ttl = "1h")).contains("missing argument `biz`"));
        assert!(err(quote!(key = "a", ttl = "0s", biz = "x")).contains("greater than zero"));
        assert!(err(quote!(key = "a", ttl = "1h", biz = "Pay")).contains("[a-z0-9_]{1,32}"));
    }
}
