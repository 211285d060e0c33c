//! `#[derive(State)]`: a state column and its transitions, checked at
//! compile time (layer 4). Parses `#[state(...)]`, checks every name and
//! transition against the enum, and writes the `State` impl plus the const
//! fn `transition!` calls, which refuses undeclared transitions.
//!
//! Input:
//!
//! ```ignore
//! #[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
//! #[state(table = "orders", id = "id", column = "status")]
//! #[state(transitions(Pending -> Paid, Paid -> Refunded))]
//! enum OrderStatus { Pending, Paid, Refunded }
//! ```
//!
//! Output: `impl ::idempotency::state::State for OrderStatus { ... }` (stored as
//! `'PENDING'`, `'PAID'`, ...) and `OrderStatus::__idem_transition(from, to)`.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Data, DeriveInput, Expr, ExprLit, ExprUnary, Ident, Lit, LitStr, Path, Token, UnOp};

const ARGUMENTS: &str = "`table`, `id`, `column`, `transitions`, `storage`, `crate`";

/// Writes the impl, or the errors plus nothing (a derive adds items only).
pub fn derive(input: TokenStream) -> TokenStream {
    match syn::parse2::<DeriveInput>(input).and_then(|input| expand(&input)) {
        Ok(tokens) => tokens,
        Err(e) => e.into_compile_error(),
    }
}

struct Transition {
    from: Ident,
    to: Ident,
}

/// How one state is stored.
#[derive(PartialEq)]
enum Value {
    Text(String),
    Int(i16),
}

impl Parse for Transition {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let from = input.parse()?;
        input.parse::<Token![->]>()?;
        Ok(Transition { from, to: input.parse()? })
    }
}

#[derive(Default)]
struct Args {
    table: Option<LitStr>,
    id: Option<LitStr>,
    column: Option<LitStr>,
    transitions: Vec<Transition>,
    int: bool,
    krate: Option<Path>,
}

fn parse_args(input: &DeriveInput) -> syn::Result<Args> {
    let mut args = Args::default();
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("state")) {
        attr.parse_nested_meta(|meta| {
            let name = meta.path.get_ident().map(ToString::to_string).unwrap_or_default();
            match name.as_str() {
                "table" => args.table = Some(identifier(meta.value()?.parse()?)?),
                "id" => args.id = Some(identifier(meta.value()?.parse()?)?),
                "column" => args.column = Some(identifier(meta.value()?.parse()?)?),
                "transitions" => {
                    let content;
                    syn::parenthesized!(content in meta.input);
                    let list = Punctuated::<Transition, Token![,]>::parse_terminated(&content)?;
                    args.transitions.extend(list);
                }
                "storage" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    args.int = match lit.value().as_str() {
                        "text" => false,
                        "int" => true,
                        _ => return Err(syn::Error::new_spanned(lit, "`storage` is \"text\" or \"int\"")),
                    };
                }
                "crate" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    args.krate = Some(lit.parse()?);
                }
                _ => {
                    let shown = meta.path.to_token_stream().to_string().replace(' ', "");
                    return Err(meta.error(format!("unknown argument `{shown}`; expected one of {ARGUMENTS}")));
                }
            }
            Ok(())
        })?;
    }
    Ok(args)
}

/// A SQL identifier (`idempotency_rules::is_sql_identifier`). Checked here for
/// the span; the runtime checks it again in a `const`.
fn identifier(lit: LitStr) -> syn::Result<LitStr> {
    if idempotency_rules::is_sql_identifier(&lit.value()) {
        Ok(lit)
    } else {
        Err(syn::Error::new_spanned(
            lit,
            "not a SQL identifier: 1 to 64 characters from A-Z a-z 0-9 _, not starting with a digit",
        ))
    }
}

/// `PartRefunded` → `PART_REFUNDED`.
fn screaming_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_uppercase());
    }
    out
}

/// A variant's discriminant as an `i16`, when written as an integer literal.
fn discriminant(expr: &Expr) -> Option<i16> {
    match expr {
        Expr::Lit(ExprLit { lit: Lit::Int(n), .. }) => n.base10_parse().ok(),
        Expr::Unary(ExprUnary { op: UnOp::Neg(_), expr, .. }) => discriminant(expr).and_then(i16::checked_neg),
        _ => None,
    }
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let Data::Enum(data) = &input.data else {
        return Err(syn::Error::new_spanned(&input.ident, "`State` is derived on an enum of states"));
    };
    if !input.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(&input.generics, "a `State` enum takes no generic parameters"));
    }
    let args = parse_args(input)?;
    let missing = |what: &str| {
        syn::Error::new(
            Span::call_site(),
            format!(
                "missing `{what}` in #[state(...)], e.g. #[state(table = \"orders\", id = \"id\", column = \"status\")]"
            ),
        )
    };
    let table = args.table.clone().ok_or_else(|| missing("table"))?;
    let id = args.id.clone().ok_or_else(|| missing("id"))?;
    let column = args.column.clone().ok_or_else(|| missing("column"))?;
    if args.transitions.is_empty() {
        return Err(missing("transitions"));
    }

    let mut errors: Option<syn::Error> = None;
    let mut push = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };

    // Each variant and how it is stored.
    let mut variants = Vec::new();
    for variant in &data.variants {
        if !matches!(variant.fields, syn::Fields::Unit) {
            push(syn::Error::new_spanned(variant, "a state is a variant without fields"));
            continue;
        }
        let mut rename = None;
        for attr in variant.attrs.iter().filter(|a| a.path().is_ident("state")) {
            let parsed = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("rename") {
                    rename = Some(meta.value()?.parse::<LitStr>()?);
                    Ok(())
                } else {
                    Err(meta.error("unknown argument; expected `rename = \"...\"`"))
                }
            });
            if let Err(e) = parsed {
                push(e);
            }
        }
        let stored = if args.int {
            if let Some(rename) = &rename {
                push(syn::Error::new_spanned(
                    rename,
                    "`rename` is for text storage; int storage uses the discriminant",
                ));
            }
            match variant.discriminant.as_ref().map(|(_, e)| (e, discriminant(e))) {
                Some((_, Some(n))) => Value::Int(n),
                Some((e, None)) => {
                    push(syn::Error::new_spanned(e, "a discriminant that fits an `i16` (SMALLINT)"));
                    continue;
                }
                None => {
                    push(syn::Error::new_spanned(
                        &variant.ident,
                        "with `storage = \"int\"` every state gives its stored number: `Paid = 1`",
                    ));
                    continue;
                }
            }
        } else {
            let text = rename.as_ref().map_or_else(|| screaming_snake(&variant.ident.to_string()), LitStr::value);
            if text.is_empty() || text.len() > 64 {
                push(syn::Error::new_spanned(&variant.ident, "a stored state has 1 to 64 bytes"));
            }
            Value::Text(text)
        };
        variants.push((variant.ident.clone(), stored));
    }

    // Duplicate stored values would make the re-read ambiguous.
    for (i, (a, sa)) in variants.iter().enumerate() {
        if let Some((b, _)) = variants[..i].iter().find(|(_, sb)| sb == sa) {
            push(syn::Error::new_spanned(a, format!("`{a}` is stored like `{b}`; each state needs its own value")));
        }
    }

    let known = |ident: &Ident| data.variants.iter().any(|v| v.ident == *ident);
    let names: Vec<String> = data.variants.iter().map(|v| format!("`{}`", v.ident)).collect();
    let mut seen: Vec<(String, String)> = Vec::new();
    for t in &args.transitions {
        for end in [&t.from, &t.to] {
            if !known(end) {
                push(syn::Error::new_spanned(
                    end,
                    format!("`{end}` is not a state of `{}`; its states are {}", input.ident, names.join(", ")),
                ));
            }
        }
        if t.from == t.to {
            push(syn::Error::new_spanned(&t.to, "a transition goes from one state to another"));
        }
        let pair = (t.from.to_string(), t.to.to_string());
        if seen.contains(&pair) {
            push(syn::Error::new_spanned(&t.to, format!("`{} -> {}` is declared twice", t.from, t.to)));
        }
        seen.push(pair);
    }
    if let Some(errors) = errors {
        return Err(errors);
    }

    let krate = args.krate.unwrap_or_else(|| syn::parse_quote!(::idempotency));
    let ty = &input.ident;
    let stored_arms = variants.iter().map(|(v, s)| match s {
        Value::Text(text) => quote!(Self::#v => #krate::state::Stored::Text(#text)),
        Value::Int(n) => quote!(Self::#v => #krate::state::Stored::Int(#n)),
    });
    let from_text_arms = variants.iter().filter_map(|(v, s)| match s {
        Value::Text(text) => Some(quote!(#text => ::core::option::Option::Some(Self::#v))),
        Value::Int(_) => None,
    });
    let from_int_arms = variants.iter().filter_map(|(v, s)| match s {
        Value::Int(n) => Some(quote!(#n => ::core::option::Option::Some(Self::#v))),
        Value::Text(_) => None,
    });
    let pairs = args.transitions.iter().map(|t| {
        let (from, to) = (&t.from, &t.to);
        quote!((Self::#from, Self::#to))
    });
    let undeclared =
        format!("this transition is not declared on `{ty}`: add it to #[state(transitions(...))] if it is allowed");
    let as_int = args.int;
    Ok(quote! {
        impl #krate::state::State for #ty {
            const TABLE: #krate::state::Ident = #krate::state::Ident::__checked(#table);
            const ID: #krate::state::Ident = #krate::state::Ident::__checked(#id);
            const COLUMN: #krate::state::Ident = #krate::state::Ident::__checked(#column);
            const STORED_AS_INT: bool = #as_int;

            fn stored(self) -> #krate::state::Stored {
                match self { #(#stored_arms,)* }
            }

            #[allow(unreachable_patterns)]
            fn from_text(text: &str) -> ::core::option::Option<Self> {
                match text { #(#from_text_arms,)* _ => ::core::option::Option::None }
            }

            #[allow(unreachable_patterns)]
            fn from_int(n: i16) -> ::core::option::Option<Self> {
                match n { #(#from_int_arms,)* _ => ::core::option::Option::None }
            }
        }

        impl #ty {
            /// Not a stable API: `idempotency::transition!` calls it in a `const`.
            #[doc(hidden)]
            pub const fn __idem_transition(from: Self, to: Self) -> #krate::state::Transition<Self> {
                match (from, to) {
                    #(#pairs)|* => #krate::state::Transition::__declared(from, to),
                    _ => ::core::panic!(#undeclared),
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(input: TokenStream) -> String {
        let out = derive(input).to_string();
        assert!(out.contains("compile_error"), "accepted: {out}");
        out
    }

    #[test]
    fn names_states_like_constants() {
        assert_eq!(screaming_snake("Pending"), "PENDING");
        assert_eq!(screaming_snake("PartRefunded"), "PART_REFUNDED");
    }

    #[test]
    fn refuses_what_cannot_be_a_state_machine() {
        let base = quote!(#[state(table = "orders", id = "id", column = "status")]);
        assert!(err(quote!(#base #[state(transitions(A -> C))] enum S { A, B })).contains("`C` is not a state of `S`"));
        assert!(err(quote!(#base #[state(transitions(A -> A))] enum S { A, B })).contains("from one state to another"));
        assert!(err(quote!(#base #[state(transitions(A -> B, A -> B))] enum S { A, B })).contains("declared twice"));
        assert!(
            err(quote!(
                #[state(table = "or ders", id = "id", column = "s", transitions(A -> B))]
                enum S {
                    A,
                    B,
                }
            ))
            .contains("not a SQL identifier")
        );
        assert!(
            err(quote!(#base #[state(transitions(A -> B), storage = "int")] enum S { A, B = 1 }))
                .contains("every state gives its stored number")
        );
        assert!(
            err(quote!(#base #[state(transitions(A -> B))] enum S { A, #[state(rename = "A")] B }))
                .contains("stored like `A`")
        );
        assert!(err(quote!(#base #[state(transitions(A -> B))] struct S;)).contains("derived on an enum"));
        assert!(
            err(quote!(#base #[state(transitions(A -> B), tabel = "x")] enum S { A, B }))
                .contains("unknown argument `tabel`")
        );
    }
}
