//! Durations written as `"30s"`, `"15m"`, `"24h"`, `"7d"`, `"1h30m"`, `"500ms"`:
//! `ttl` and `lease`. The rule itself (units, zero, the 100-year bound) is
//! `idempotency_rules::parse_duration`, shared with the runtime.

use syn::LitStr;

/// Milliseconds in `lit`, or an error on it naming the argument (`what`).
pub fn duration(lit: LitStr, what: &str) -> syn::Result<u64> {
    idempotency_rules::parse_duration(&lit.value())
        .map_err(|reason| syn::Error::new_spanned(&lit, format!("invalid `{what}`: {reason}")))
}

#[cfg(test)]
mod tests {
    use super::duration;
    use syn::LitStr;

    fn lit(text: &str) -> LitStr {
        LitStr::new(text, proc_macro2::Span::call_site())
    }

    #[test]
    fn reads_milliseconds_and_names_the_argument_on_error() {
        assert_eq!(duration(lit("1h30m"), "ttl").unwrap(), 5_400_000);
        let error = duration(lit("5x"), "lease").unwrap_err().to_string();
        assert!(error.starts_with("invalid `lease`: unknown unit `x` in `5x`"), "{error}");
        let error = duration(lit("36500d1ms"), "ttl").unwrap_err().to_string();
        assert!(error.contains("100 years"), "{error}");
    }
}
