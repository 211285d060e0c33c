//! Writes the code.
//!
//! Input:
//!
//! ```ignore
//! #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
//! async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64) -> Result<Receipt, PayError> {
//!     body
//! }
//! ```
//!
//! Output:
//!
//! ```ignore
//! async fn pay(idem: &Idem<MySql>, order_id: u64) -> Result<Receipt, PayError> {
//!     const __IDEM_SPEC: ::idempotency::__private::Spec = ::idempotency::__private::Spec {
//!         biz: "pay", ttl: .., lease: .., wait: None, record_errors: false,
//!     };
//!     let __idem_key = ::idempotency::__private::render(::core::format_args!("order_{}_pay", order_id));
//!     let __idem_biz_no = ::core::option::Option::None;
//!     let __idem_fingerprint = ::idempotency::__private::Fingerprint::new().arg("order_id", &order_id);
//!     let __idem_engine = ::core::clone::Clone::clone(&(idem));
//!     let mut __idem_body = ::idempotency::__private::Body::new(move |mut __idem_tx| async move {
//!         let __idem_out: Result<Receipt, PayError> = {
//!             let tx: &mut Transaction<'_, MySql> = &mut __idem_tx;
//!             async move { body }.await
//!         };
//!         (__idem_tx, __idem_out)
//!     });
//!     let __idem_ended = ::idempotency::__private::run(::core::convert::AsRef::<::idempotency::Idem<_>>::as_ref(&__idem_engine),
//!         &__IDEM_SPEC, __idem_key, __idem_fingerprint, __idem_biz_no, &mut __idem_body).await;
//!     __idem_body.answer(__idem_ended)
//! }
//! ```
//!
//! `run` is generic over the backend only: it takes the body behind `dyn`
//! (`Body`), so the call flow is built once per backend and each fn adds
//! its body, its value's JSON (`Body::run`, `Body::decode`) and
//! `Body::answer`. `Body::new` is where the value's serde bounds are asked
//! for, spanned on the return type: one error there, and none at the cast.
//! With `record_errors`, `Body::recording` in place of `Body::new` (it asks
//! `idempotency::BusinessError` of the error type), and `record_errors: true`
//! in the spec; `wait = "5s"` is `wait: Some(5 s)` there.
//!
//! A parameter marked `#[idem(skip_if_default)]` goes in with
//! `.arg_unless_default("coupon", &coupon)` instead of `.arg(..)`.
//!
//! The `let __idem_out: <declared return type>` keeps the user's signature in
//! charge of inference, so type errors in the body land on the body. Every
//! `::idempotency` above is the `crate = "..."` path when one is given.
//!
//! With `steps`, the same, but the call goes to `run_steps` and the body
//! gets the step context where it would get the transaction:
//!
//! ```ignore
//! let mut __idem_body = ::idempotency::__private::Body::new(move |mut __idem_steps| async move {
//!     let __idem_out: Result<Receipt, PayError> = {
//!         let steps: &mut Steps<MySql> = &mut __idem_steps;
//!         async move { body }.await
//!     };
//!     (__idem_steps, __idem_out)
//! });
//! ::idempotency::__private::run_steps(/* the same arguments */, &mut __idem_body).await
//! ```
//!
//! With `join`, the transaction stays a parameter (the caller passes it);
//! the call goes to `run_joined` with it, and the body gets a savepoint of
//! it where it would get the engine's transaction:
//!
//! ```ignore
//! ::idempotency::__private::run_joined(/* the same arguments */, tx, &mut __idem_body).await
//! ```
//!
//! A method of an `#[async_trait]` impl arrives as a fn returning
//! `Pin<Box<dyn Future<..>>>`: `async_trait` unboxes it before the rewrite
//! and boxes the result again (its own Input/Output at its top).

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::ItemFn;

use crate::async_trait;
use crate::attr::{self, Args};
use crate::key::{Piece, Template};
use crate::sig::{self, Checked, Fingerprinted};

pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut func: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            // Not a fn at all: keep the item as written for the IDE's sake.
            let message = if syn::parse2::<syn::ItemImpl>(item.clone()).is_ok() {
                "#[idempotent] goes on a method, not on its impl: put it on the `async fn` inside \
                 (under `#[async_trait]` too, which stays on the impl)"
            } else {
                "#[idempotent] applies to an `async fn`"
            };
            let mut out = item;
            out.extend(syn::Error::new(e.span(), message).into_compile_error());
            return out;
        }
    };
    // A method of an `#[async_trait]` impl arrives expanded already.
    let boxed = async_trait::unbox(&mut func);
    let join = names_flag(&args, "join");
    let checked = attr::parse(args).and_then(|args| sig::check(&mut func, &args).map(|c| (args, c)));
    match checked {
        Ok((args, checked)) => {
            rewrite(&mut func, &args, checked);
            if let Some(boxed) = boxed {
                async_trait::rebox(&mut func, boxed);
            }
            quote!(#func)
        }
        Err(e) => {
            // Beside the error, the fn as its callers see it, so that they
            // (and axum's `debug_handler`, the router, the trait) still
            // type-check and report nothing more.
            as_called(&mut func, join);
            if let Some(boxed) = boxed {
                async_trait::rebox(&mut func, boxed);
            }
            let mut out = e.into_compile_error();
            out.extend(quote!(#[allow(unused_variables, unreachable_code)] #func));
            out
        }
    }
}

/// Whether the attribute's arguments hold the bare word `flag`, read
/// without parsing them (they may not parse).
fn names_flag(args: &TokenStream, flag: &str) -> bool {
    let tokens: Vec<TokenTree> = args.clone().into_iter().collect();
    tokens.iter().enumerate().any(|(at, token)| {
        let bare = match tokens.get(at + 1) {
            None => true,
            Some(TokenTree::Punct(punct)) => punct.as_char() == ',',
            Some(_) => false,
        };
        matches!(token, TokenTree::Ident(ident) if ident == flag) && bare
    })
}

/// The fn a failed expansion emits: its signature as the attribute would
/// have left it (without the engine's transaction, unless `join`, and
/// without the step context: parameters callers never pass), and its own
/// body, which gets them as values that never exist (the error stops the
/// build before anything runs), so the body is still type-checked. Minus
/// `#[idem(..)]`, which only this macro knows.
fn as_called(func: &mut ItemFn, join: bool) {
    let mut handed = Vec::new();
    let inputs = std::mem::take(&mut func.sig.inputs);
    for mut input in inputs {
        if let syn::FnArg::Typed(param) = &mut input {
            param.attrs.retain(|a| !a.path().is_ident("idem"));
            let supplied =
                (!join && sig::is_ref_to(&param.ty, "Transaction", true)) || sig::is_ref_to(&param.ty, "Steps", true);
            if supplied && let syn::Pat::Ident(_) = &*param.pat {
                let (pat, ty) = (&param.pat, sig::elide_lifetimes((*param.ty).clone()));
                handed.push(quote!(let #pat: #ty = ::core::unreachable!();));
                continue;
            }
        }
        func.sig.inputs.push(input);
    }
    if !handed.is_empty() {
        let block = &func.block;
        func.block = syn::parse_quote!({ #(#handed)* #block });
    }
}

fn rewrite(func: &mut ItemFn, args: &Args, checked: Checked) {
    let Checked { engine, tx, tx_index, steps, steps_index, fingerprinted, ret } = checked;
    // The engine supplies these: callers never pass them (but for `join`'s
    // transaction, which is the caller's).
    let supplied = [tx_index.filter(|_| args.join.is_none()), steps_index];
    if supplied.iter().any(Option::is_some) {
        func.sig.inputs = std::mem::take(&mut func.sig.inputs)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !supplied.contains(&Some(*i)))
            .map(|(_, input)| input)
            .collect();
    }

    let krate = &args.krate;
    let biz = &args.biz;
    let ttl = args.ttl_ms;
    let lease = args.lease_ms;
    let key = render(krate, &args.key.1);
    let biz_no = match &args.biz_no {
        Some((_, template)) => {
            let rendered = render(krate, template);
            quote!(::core::option::Option::Some(#rendered))
        }
        None => quote!(::core::option::Option::None),
    };
    // In the document's key order (names are unique), so the canonical
    // writer finds its entries sorted and moves none of them.
    let mut fingerprinted: Vec<&Fingerprinted> = fingerprinted.iter().collect();
    fingerprinted.sort_by_cached_key(|arg| arg.name.to_string());
    let fingerprint_args = fingerprinted.iter().map(|Fingerprinted { name, span, unless_default }| {
        let label = name.to_string();
        // At the type's span too, so a missing trait is "required by" the parameter.
        let method = syn::Ident::new(if *unless_default { "arg_unless_default" } else { "arg" }, *span);
        quote_spanned!(*span=> .#method(#label, &#name))
    });
    // The plain mode hands the body the transaction; `steps`, the step
    // context; `join`, a savepoint of the caller's transaction, which goes
    // in as an argument.
    let mut callers_tx = None;
    let (entry, handed, bind) = match steps {
        Some((pat, ty)) => (quote!(run_steps), quote!(__idem_steps), Some(quote!(let #pat: #ty = &mut __idem_steps;))),
        None => {
            let entry = if args.join.is_some() { quote!(run_joined) } else { quote!(run) };
            if let (Some(_), Some((syn::Pat::Ident(name), _))) = (&args.join, &tx) {
                let name = &name.ident;
                callers_tx = Some(quote!(#name,));
            }
            (entry, quote!(__idem_tx), tx.map(|(pat, ty)| quote!(let #pat: #ty = &mut __idem_tx;)))
        }
    };
    let block = &func.block;
    let ret_span = syn::spanned::Spanned::span(&ret);

    // Spanned on the return type, so "`T: Serialize` is not satisfied" points there.
    let krate_at_ret = respan(krate.to_token_stream(), ret_span);
    let body_new = if args.record_errors.is_some() {
        quote_spanned!(ret_span=> #krate_at_ret::__private::Body::recording)
    } else {
        quote_spanned!(ret_span=> #krate_at_ret::__private::Body::new)
    };
    let wait = match args.wait_ms {
        Some(ms) => quote!(::core::option::Option::Some(::core::time::Duration::from_millis(#ms))),
        None => quote!(::core::option::Option::None),
    };
    let record_errors = args.record_errors.is_some();
    let body = quote!({
        const __IDEM_SPEC: #krate::__private::Spec = #krate::__private::Spec {
            biz: #biz,
            ttl: ::core::time::Duration::from_millis(#ttl),
            lease: ::core::time::Duration::from_millis(#lease),
            wait: #wait,
            record_errors: #record_errors,
        };
        let __idem_key = #key;
        let __idem_biz_no = #biz_no;
        let __idem_fingerprint = #krate::__private::Fingerprint::new() #(#fingerprint_args)*;
        let __idem_engine = ::core::clone::Clone::clone(&(#engine));
        // The fn item alone, at the return type's span: a value that cannot
        // be stored is reported there, once.
        let __idem_new = #body_new;
        let mut __idem_body = __idem_new(move |mut #handed| async move {
            let __idem_out: #ret = {
                #bind
                async move #block.await
            };
            (#handed, __idem_out)
        });
        let __idem_ended = #krate::__private::#entry(
            ::core::convert::AsRef::<#krate::Idem<_>>::as_ref(&__idem_engine),
            &__IDEM_SPEC,
            __idem_key,
            __idem_fingerprint,
            __idem_biz_no,
            #callers_tx
            &mut __idem_body,
        )
        .await;
        __idem_body.answer(__idem_ended)
    });
    func.block = syn::parse2(body).expect("generated block parses");
}

/// `tokens`, every one of them at `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            token.set_span(span);
            token
        })
        .collect()
}

/// `::idempotency::__private::render(::core::format_args!("order_{}_pay", &order_id))`
/// for `order_<order_id>_pay`.
fn render(krate: &impl ToTokens, template: &Template) -> TokenStream {
    let mut format = String::new();
    let mut values = Vec::new();
    for piece in &template.pieces {
        match piece {
            // Literal text holds only key characters, so no braces to escape.
            Piece::Text(text) => format.push_str(text),
            Piece::Param(path) => {
                format.push_str("{}");
                // Every segment was checked to parse as Rust (`key.rs`).
                let mut expr: TokenStream = if path[0] == "self" {
                    quote!(self)
                } else {
                    let root: syn::Ident = syn::parse_str(&path[0]).expect("template checked its root");
                    quote!(#root)
                };
                for field in &path[1..] {
                    let member: syn::Member = syn::parse_str(field).expect("template checked fields");
                    expr = quote!(#expr.#member);
                }
                values.push(quote!(&#expr));
            }
        }
    }
    quote!(#krate::__private::render(::core::format_args!(#format #(, #values)*)))
}

#[cfg(test)]
mod tests {
    use proc_macro2::TokenTree;
    use quote::quote;

    /// Every identifier in `tokens`, at any depth.
    fn idents(tokens: proc_macro2::TokenStream, out: &mut Vec<String>) {
        for token in tokens {
            match token {
                TokenTree::Ident(ident) => out.push(ident.to_string()),
                TokenTree::Group(group) => idents(group.stream(), out),
                _ => {}
            }
        }
    }

    fn expanded(args: proc_macro2::TokenStream) -> Vec<String> {
        let item = quote! {
            async fn pay(engine: &Idem<Db>, tx: &mut Transaction<'_, Db>, order_id: u64) -> Result<u64, Error> {
                Ok(order_id)
            }
        };
        let mut out = Vec::new();
        idents(super::idempotent(args, item), &mut out);
        out
    }

    fn expanded_with(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> Vec<String> {
        let mut out = Vec::new();
        idents(super::idempotent(args, item), &mut out);
        out
    }

    /// Guards the plain mode against the `steps` branch: without `steps`
    /// the body still gets the transaction and calls `run`.
    #[test]
    fn only_steps_calls_run_steps() {
        let plain = expanded(quote!(key = "o_<order_id>", ttl = "1h", biz = "pay"));
        assert!(plain.iter().any(|i| i == "run") && plain.iter().any(|i| i == "__idem_tx"), "{plain:?}");
        assert!(!plain.iter().any(|i| i == "run_steps" || i == "__idem_steps"), "{plain:?}");

        let item = quote! {
            async fn charge(engine: &Idem<Db>, steps: &mut Steps<Db>, order_id: u64) -> Result<u64, Error> {
                Ok(order_id)
            }
        };
        let two_phase = expanded_with(quote!(key = "o_<order_id>", ttl = "1h", biz = "charge", steps), item);
        assert!(two_phase.iter().any(|i| i == "run_steps") && two_phase.iter().any(|i| i == "__idem_steps"));
        assert!(!two_phase.iter().any(|i| i == "run" || i == "__idem_tx" || i == "compile_error"), "{two_phase:?}");
        // The step context is not an argument: neither in the signature nor in the fingerprint.
        let signature = two_phase.iter().position(|i| i == "charge").unwrap();
        let body = two_phase.iter().position(|i| i == "__IDEM_SPEC").unwrap();
        assert!(!two_phase[signature..body].iter().any(|i| i == "Steps"), "{two_phase:?}");
        assert!(!two_phase.windows(2).any(|w| w[0] == "arg" && w[1] == "steps"));
    }

    /// Guards `join` against the plain mode: the caller's transaction stays
    /// in the signature and goes to `run_joined`, ahead of the body.
    #[test]
    fn join_hands_the_callers_transaction_to_run_joined() {
        let joined = expanded(quote!(key = "o_<order_id>", ttl = "1h", biz = "pay", join));
        assert!(joined.iter().any(|i| i == "run_joined"), "{joined:?}");
        assert!(!joined.iter().any(|i| i == "run" || i == "compile_error"), "{joined:?}");
        let signature = joined.iter().position(|i| i == "pay").unwrap();
        let body = joined.iter().position(|i| i == "__IDEM_SPEC").unwrap();
        assert!(joined[signature..body].iter().any(|i| i == "Transaction"), "the caller passes it: {joined:?}");
        assert!(joined.windows(2).any(|w| w == ["__idem_biz_no", "tx"]), "{joined:?}");
        assert!(!joined.windows(2).any(|w| w[0] == "arg" && w[1] == "tx"), "never fingerprinted");

        let plain = expanded(quote!(key = "o_<order_id>", ttl = "1h", biz = "pay"));
        let signature = plain.iter().position(|i| i == "pay").unwrap();
        let body = plain.iter().position(|i| i == "__IDEM_SPEC").unwrap();
        assert!(!plain[signature..body].iter().any(|i| i == "Transaction"), "the engine supplies it: {plain:?}");
    }

    /// Only the marked parameter goes in by `arg_unless_default`; the
    /// others keep `arg`, whose bytes records already hold. All go in by
    /// name, so the canonical writer sorts nothing.
    #[test]
    fn skip_if_default_changes_only_its_own_argument() {
        let item = quote! {
            async fn pay(
                engine: &Idem<Db>,
                order_id: u64,
                #[idem(skip_if_default)] coupon: Option<String>,
                amount: i64,
            ) -> Result<u64, Error> {
                Ok(order_id)
            }
        };
        let out = expanded_with(quote!(key = "o_<order_id>", ttl = "1h", biz = "pay"), item);
        let calls: Vec<(&str, &str)> = out
            .windows(2)
            .filter(|w| w[0] == "arg" || w[0] == "arg_unless_default")
            .map(|w| (w[0].as_str(), w[1].as_str()))
            .collect();
        // In the document's key order, not the parameters'.
        assert_eq!(calls, [("arg", "amount"), ("arg_unless_default", "coupon"), ("arg", "order_id")], "{out:?}");
        assert!(!out.iter().any(|i| i == "skip_if_default" || i == "compile_error"), "{out:?}");
    }

    /// Regression: beside an attribute's error, the fn as written (with the
    /// transaction callers never pass) made axum's `debug_handler` report
    /// E0637 and the router a missing `Handler`, and callers too many
    /// arguments. It is emitted as callers see it, its body still checked.
    #[test]
    fn a_failed_expansion_emits_the_fn_as_its_callers_see_it() {
        let item = quote! {
            async fn pay(
                engine: &Idem<Db>,
                tx: &mut Transaction<'c, Db>,
                #[idem(skip)] trace: u8,
                order_id: u64,
            ) -> Result<u64, Error> {
                Ok(order_id)
            }
        };
        for args in [quote!(key = "o_<order_id>", tll = "1h", biz = "pay"), quote!(key = "o_<order_id>", biz = "pay")] {
            let out = super::idempotent(args, item.clone()).to_string().replace(' ', "");
            assert!(out.starts_with("::core::compile_error!"), "{out}");
            assert!(
                out.contains("asyncfnpay(engine:&Idem<Db>,trace:u8,order_id:u64)->Result<u64,Error>"),
                "the signature callers see: {out}"
            );
            assert!(out.contains("{lettx:&mutTransaction<'_,Db>=::core::unreachable!();{Ok(order_id)}}"), "{out}");
            assert!(!out.contains("idem(skip)"), "{out}");
        }
        // With `join` the caller passes it: it stays, even when the rest does not parse.
        let out = super::idempotent(quote!(key = "o_<order_id>", ttl = 1h, biz = "pay", join), item).to_string();
        assert!(out.replace(' ', "").contains("tx:&mutTransaction<'c,Db>,"), "{out}");
        assert!(!out.contains("unreachable !"), "{out}");
    }

    #[test]
    fn a_flag_is_found_without_parsing() {
        let found = |args: proc_macro2::TokenStream| super::names_flag(&args, "join");
        assert!(found(quote!(key = "k", join)) && found(quote!(join, ttl = 1h)) && found(quote!(join)));
        assert!(!found(quote!(key = "join")) && !found(quote!(join = true)) && !found(quote!(key = "k")));
    }

    /// Regression for `crate = "..."`: a path left as `::idempotency` would still
    /// compile wherever the facade is also a direct dependency (as in the ui
    /// tests), so no `idempotency` may be left in the code at all.
    #[test]
    fn the_crate_path_replaces_every_default_path() {
        let default = expanded(quote!(key = "o_<order_id>", ttl = "1h", biz = "pay", biz_no = "<order_id>"));
        assert!(default.iter().filter(|i| *i == "idempotency").count() >= 5, "{default:?}");
        let renamed = expanded(quote!(
            key = "o_<order_id>",
            ttl = "1h",
            biz = "pay",
            biz_no = "<order_id>",
            crate = "my::deps::renamed"
        ));
        assert!(!renamed.iter().any(|i| i == "idempotency"), "{renamed:?}");
        let paths = renamed.windows(3).filter(|w| w == &["my", "deps", "renamed"]).count();
        assert_eq!(paths, default.iter().filter(|i| *i == "idempotency").count());
    }
}
