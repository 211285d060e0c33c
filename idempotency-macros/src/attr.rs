//! Parses `#[idempotent(key = "...", ttl = "...", biz = "...", ...)]`.

use idempotency_rules::{MAX_BIZ_LEN, MAX_BIZ_NO_LEN, MAX_KEY_LEN, is_valid_biz};
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitStr, Path, Token};

use crate::key::{Piece, Template, parse_template};
use crate::ttl::duration;

/// Every argument the parser takes: the reference (`idempotent`'s docs in
/// `lib.rs`) has a row for each, and a test there holds the two together.
pub const ARGUMENT_NAMES: [&str; 11] =
    ["key", "ttl", "biz", "lease", "biz_no", "engine", "crate", "steps", "join", "wait", "record_errors"];
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
    /// The path the generated code reaches the facade through: `::idempotency`
    /// unless `crate = "..."` names another.
    pub krate: Path,
    /// `steps`: the two-phase mode for calls to outside services, the
    /// argument's own token (for spans) when given.
    pub steps: Option<Ident>,
    /// `join`: the body joins the transaction the caller passes; the
    /// argument's own token when given.
    pub join: Option<Ident>,
    /// `wait = "5s"`: how long a duplicate waits for a running call's
    /// answer (`"0s"`: not at all); the engine's default when absent.
    pub wait_ms: Option<u64>,
    /// `record_errors`: errors the fn's error type declares final
    /// (`BusinessError`) are recorded and replayed; the argument's token.
    pub record_errors: Option<Ident>,
}

pub fn parse(tokens: TokenStream) -> syn::Result<Args> {
    let mut key = None;
    let mut ttl = None;
    let mut biz = None;
    let mut lease = None;
    let mut biz_no = None;
    let mut engine = None;
    let mut krate = None;
    let mut steps = None;
    let mut join = None;
    let mut wait = None;
    let mut record_errors = None;

    let parser = syn::meta::parser(|meta| {
        // Only a listed name reaches its arm: an arm the list lacks is never taken.
        let Some(name) = ARGUMENT_NAMES.into_iter().find(|name| meta.path.is_ident(name)) else {
            return Err(unknown(&meta));
        };
        let value = || meta.value()?.parse::<LitStr>();
        match name {
            "key" => set(&mut key, &meta, name, || template(value()?, MAX_KEY_LEN)),
            "ttl" => set(&mut ttl, &meta, name, || duration(value()?, "ttl")),
            "biz" => set(&mut biz, &meta, name, || biz_name(value()?)),
            "lease" => set(&mut lease, &meta, name, || Ok((duration(value()?, "lease")?, meta.path.span()))),
            "biz_no" => set(&mut biz_no, &meta, name, || template(value()?, MAX_BIZ_NO_LEN)),
            "engine" => set(&mut engine, &meta, name, || meta.value()?.parse::<Expr>()),
            "crate" => set(&mut krate, &meta, name, || crate_path(value()?)),
            "steps" => set(&mut steps, &meta, name, || flag(&meta)),
            "join" => set(&mut join, &meta, name, || flag(&meta)),
            "wait" => set(&mut wait, &meta, name, || wait_ms(value()?)),
            "record_errors" => set(&mut record_errors, &meta, name, || flag(&meta)),
            _ => Err(unknown(&meta)),
        }
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
    if let (Some(join), Some(steps)) = (&join, &steps) {
        let mut error = syn::Error::new_spanned(
            join,
            "`join` and `steps` exclude each other: `steps` commits phases of its own around outside calls, \
             which a transaction the caller holds cannot contain",
        );
        error.combine(syn::Error::new_spanned(steps, "`steps` given here"));
        return Err(error);
    }
    if let (Some(record), Some(steps)) = (&record_errors, &steps) {
        let mut error = syn::Error::new_spanned(
            record,
            "`record_errors` and `steps` exclude each other: a `steps` body records a final failure with \
             `Steps::permanent`, which replays as `Error::Permanent`",
        );
        error.combine(syn::Error::new_spanned(steps, "`steps` given here"));
        return Err(error);
    }
    if let (Some(_), Some((_, at))) = (&join, &lease) {
        return Err(syn::Error::new(
            *at,
            "`lease` bounds a Redis claim, and `join` takes none (the record in the caller's transaction \
             keeps duplicates out): remove `lease`",
        ));
    }
    Ok(Args {
        key: key.ok_or_else(|| missing("key", "the key template"))?,
        ttl_ms: ttl.ok_or_else(|| missing("ttl", "how long the record protects the key"))?,
        biz: biz.ok_or_else(|| missing("biz", "the business action"))?,
        lease_ms: lease.map_or(DEFAULT_LEASE_MS, |(ms, _)| ms),
        biz_no,
        engine,
        krate: krate.unwrap_or_else(|| syn::parse_quote!(::idempotency)),
        steps,
        join,
        wait_ms: wait,
        record_errors,
    })
}

/// "unknown argument `tll`; expected one of `key`, `ttl`, ...": the valid
/// names, as tokio's macros list theirs.
fn unknown(meta: &ParseNestedMeta<'_>) -> syn::Error {
    let shown = meta.path.to_token_stream().to_string().replace(' ', "");
    let expected: Vec<String> = ARGUMENT_NAMES.iter().map(|name| format!("`{name}`")).collect();
    meta.error(format!("unknown argument `{shown}`; expected one of {}", expected.join(", ")))
}

/// `wait`'s milliseconds: a duration as `ttl` takes it, or zero (`"0s"`:
/// a duplicate does not wait).
fn wait_ms(lit: LitStr) -> syn::Result<u64> {
    match idempotency_rules::parse_duration(&lit.value()) {
        Err(idempotency_rules::DurationError::Zero { .. }) => Ok(0),
        _ => duration(lit, "wait"),
    }
}

/// Fills an argument's slot once; a second mention is an error.
fn set<T>(
    slot: &mut Option<T>,
    meta: &ParseNestedMeta<'_>,
    name: &str,
    parse: impl FnOnce() -> syn::Result<T>,
) -> syn::Result<()> {
    if slot.is_some() {
        return Err(meta.error(format!("duplicate argument `{name}`")));
    }
    *slot = Some(parse()?);
    Ok(())
}

/// A template whose literal text alone is longer than what it renders may
/// hold could only ever render rejected values: refused here.
fn template(lit: LitStr, max: usize) -> syn::Result<(LitStr, Template)> {
    let t = parse_template(&lit.value()).map_err(|m| syn::Error::new_spanned(&lit, m))?;
    let literal: usize = t.pieces.iter().map(|p| if let Piece::Text(text) = p { text.len() } else { 0 }).sum();
    if literal > max {
        let message = format!("the template's literal text is {literal} bytes; what it renders may hold at most {max}");
        return Err(syn::Error::new_spanned(&lit, message));
    }
    Ok((lit, t))
}

/// A bare word (`steps`, `join`), which takes no value.
fn flag(meta: &ParseNestedMeta<'_>) -> syn::Result<Ident> {
    let word = meta.path.get_ident().cloned().ok_or_else(|| meta.error("expected a bare word"))?;
    if !meta.input.is_empty() && !meta.input.peek(Token![,]) {
        return Err(meta.error(format!("`{word}` takes no value: write `{word}` alone")));
    }
    Ok(word)
}

fn biz_name(lit: LitStr) -> syn::Result<LitStr> {
    if !is_valid_biz(&lit.value()) {
        return Err(syn::Error::new_spanned(
            &lit,
            format!("`biz` must match [a-z0-9_]{{1,{MAX_BIZ_LEN}}}, e.g. \"pay\" or \"order_refund\""),
        ));
    }
    Ok(lit)
}

/// `crate = "my_mod::idempotency"`: a module-style path (no generics), kept with
/// the literal's span, so `crate::` in it means the user's crate and an
/// unresolved path is reported on the literal.
fn crate_path(lit: LitStr) -> syn::Result<Path> {
    lit.parse_with(Path::parse_mod_style).map_err(|_| {
        syn::Error::new_spanned(
            &lit,
            "`crate` must be the path to the idempotency crate, e.g. `crate = \"idempotency\"` or `crate = \"my_mod::idempotency\"`",
        )
    })
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
        assert!(err(quote!(krate = "idem")).contains("`engine`, `crate`"));
        assert!(err(quote!(key = "a", key = "b")).contains("duplicate argument `key`"));
        assert!(err(quote!(ttl = "1h", biz = "x")).contains("missing argument `key`"));
        assert!(err(quote!(key = "a", biz = "x")).contains("missing argument `ttl`"));
        assert!(err(quote!(key = "a", ttl = "1h")).contains("missing argument `biz`"));
        assert!(err(quote!(key = "a", ttl = "0s", biz = "x")).contains("greater than zero"));
        assert!(err(quote!(key = "a", ttl = "1h", biz = "Pay")).contains("[a-z0-9_]{1,32}"));
    }

    /// Guards the list the reference is held to: every listed name reaches
    /// its own arm (a bare word or a value is asked of it, never "unknown").
    #[test]
    fn every_listed_argument_is_parsed() {
        for name in ARGUMENT_NAMES {
            let word: TokenStream = name.parse().unwrap();
            let message = match parse(quote!(key = "k", ttl = "1s", biz = "b", #word)) {
                Ok(_) => String::new(),
                Err(e) => e.to_string(),
            };
            assert!(!message.contains("unknown argument"), "{name}: {message}");
        }
        let listed = err(quote!(nope));
        for name in ARGUMENT_NAMES {
            assert!(listed.contains(&format!("`{name}`")), "{listed}");
        }
    }

    #[test]
    fn steps_is_a_bare_word() {
        assert!(parse(quote!(key = "k", ttl = "1s", biz = "b")).unwrap().steps.is_none());
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b", steps)).unwrap();
        assert_eq!(a.steps.unwrap().to_string(), "steps");
        assert!(parse(quote!(steps, key = "k", ttl = "1s", biz = "b")).unwrap().steps.is_some());
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", steps = true)).contains("`steps` takes no value"));
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", steps(x))).contains("`steps` takes no value"));
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", steps, steps)).contains("duplicate argument `steps`"));
        assert!(err(quote!(stesp)).contains("`crate`, `steps`"));
    }

    #[test]
    fn join_is_a_bare_word_without_steps_or_lease() {
        assert!(parse(quote!(key = "k", ttl = "1s", biz = "b")).unwrap().join.is_none());
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b", join)).unwrap();
        assert_eq!(a.join.unwrap().to_string(), "join");
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", join = true)).contains("`join` takes no value"));
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", join, join)).contains("duplicate argument `join`"));
        assert!(
            err(quote!(key = "k", ttl = "1s", biz = "b", join, steps))
                .contains("`join` and `steps` exclude each other")
        );
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", lease = "5s", join)).contains("remove `lease`"));
        assert!(err(quote!(jion)).contains("`steps`, `join`"));
    }

    #[test]
    fn wait_is_a_duration_or_zero_and_record_errors_a_bare_word_without_steps() {
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b")).unwrap();
        assert!(a.wait_ms.is_none() && a.record_errors.is_none());
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b", wait = "5s", record_errors)).unwrap();
        assert_eq!(a.wait_ms, Some(5_000));
        assert_eq!(a.record_errors.unwrap().to_string(), "record_errors");
        for zero in ["0s", "0ms", "00m"] {
            assert_eq!(
                parse(quote!(key = "k", ttl = "1s", biz = "b", wait = #zero)).unwrap().wait_ms,
                Some(0),
                "{zero}"
            );
        }
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", wait = "5x")).contains("invalid `wait`: unknown unit"));
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", wait = "0")).contains("invalid `wait`"));
        assert!(
            err(quote!(key = "k", ttl = "1s", biz = "b", record_errors = true))
                .contains("`record_errors` takes no value")
        );
        assert!(
            err(quote!(key = "k", ttl = "1s", biz = "b", steps, record_errors))
                .contains("`record_errors` and `steps` exclude each other")
        );
        assert!(err(quote!(wiat = "1s")).contains("`wait`, `record_errors`"));
    }

    #[test]
    fn crate_names_the_path_to_idem() {
        let path = |a: &Args| a.krate.to_token_stream().to_string().replace(' ', "");
        let a = parse(quote!(key = "k", ttl = "1s", biz = "b")).unwrap();
        assert_eq!(path(&a), "::idempotency");
        for given in
            ["renamed", "::renamed", "crate::deps::idempotency", "self::idempotency", "super::platform::idempotency"]
        {
            let a = parse(quote!(key = "k", ttl = "1s", biz = "b", crate = #given)).unwrap();
            assert_eq!(path(&a), given);
        }
        for bad in ["", "my idem", "a::", "a::b<T>", "a.b", "::"] {
            let e = err(quote!(key = "k", ttl = "1s", biz = "b", crate = #bad));
            assert!(e.contains("`crate` must be the path to the idempotency crate"), "{bad:?}: {e}");
        }
        assert!(err(quote!(crate = "a", crate = "b")).contains("duplicate argument `crate`"));
        assert!(err(quote!(key = "k", ttl = "1s", biz = "b", crate = idem)).contains("expected string literal"));
    }

    #[test]
    fn refuses_literal_text_too_long_to_render() {
        let key = format!("{}_<id>", "k".repeat(255));
        assert!(err(quote!(key = #key, ttl = "1h", biz = "b")).contains("literal text is 256 bytes"));
        let biz_no = format!("{}<id>", "n".repeat(65));
        assert!(err(quote!(key = "k", ttl = "1h", biz = "b", biz_no = #biz_no)).contains("at most 64"));
        let key = format!("{}<id>", "k".repeat(255));
        assert!(
            parse(quote!(key = #key, ttl = "1h", biz = "b")).is_ok(),
            "255 bytes of text pass: a placeholder may render empty"
        );
    }
}
