//! Checks the annotated fn against the arguments: async, returns `Result`,
//! has an engine, and every placeholder names one of its parameters. Finds
//! the transaction parameter (supplied by the engine, or in `join` mode by
//! the caller), or in `steps` mode the step context, and the parameters
//! that go into the fingerprint.

use std::collections::BTreeSet;

use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{Expr, FnArg, Ident, ItemFn, Pat, PatType, ReturnType, Type};

use crate::attr::Args;
use crate::key::Template;

/// What expansion needs to know about the fn.
pub struct Checked {
    /// Where the engine comes from.
    pub engine: Expr,
    /// The transaction parameter: its binding and its type with lifetimes elided.
    pub tx: Option<(Pat, Type)>,
    /// Index of the transaction parameter in `sig.inputs`.
    pub tx_index: Option<usize>,
    /// In `steps` mode, the step context parameter: binding and type.
    pub steps: Option<(Pat, Type)>,
    /// Index of the step context parameter in `sig.inputs`.
    pub steps_index: Option<usize>,
    /// Bindings that go into the fingerprint, with the span of their type.
    pub fingerprinted: Vec<Fingerprinted>,
    /// The declared return type.
    pub ret: Type,
}

/// A binding that goes into the fingerprint.
pub struct Fingerprinted {
    pub name: Ident,
    /// The span of its parameter's type, where a missing trait is reported.
    pub span: Span,
    /// `#[idem(skip_if_default)]`: left out while it equals its `Default`.
    pub unless_default: bool,
}

/// Every option `#[idem(...)]` takes on a parameter: the reference
/// (`idempotent`'s docs in `lib.rs`) has a row for each, and a test there
/// holds the two together.
pub const PARAMETER_OPTIONS: [&str; 2] = ["skip", "skip_if_default"];

/// What a parameter's `#[idem(...)]` says about the fingerprint.
#[derive(Clone, Copy)]
enum Marker {
    /// Nothing: the parameter counts.
    None,
    /// `skip`: never counts.
    Skip,
    /// `skip_if_default`: counts unless it equals its `Default`; the
    /// option's span, for errors on parameters that are never fingerprinted.
    SkipIfDefault(Span),
}

/// Checks `func` against `args`; strips `#[idem(...)]` from its parameters
/// (also when it fails, so the fn emitted beside the error still compiles).
pub fn check(func: &mut ItemFn, args: &Args) -> syn::Result<Checked> {
    let mut errors = Vec::new();
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new_spanned(sig.fn_token, "#[idempotent] requires an `async fn`"));
    }
    let ret = match &sig.output {
        ReturnType::Type(_, ty) if is_result(ty) => Some((**ty).clone()),
        ReturnType::Type(_, ty) => {
            errors.push(syn::Error::new_spanned(ty, "#[idempotent] fn must return `Result<T, E>`"));
            None
        }
        ReturnType::Default => {
            errors.push(syn::Error::new_spanned(&sig.ident, "#[idempotent] fn must return `Result<T, E>`"));
            None
        }
    };
    let has_receiver = sig.receiver().is_some();

    let mut engine_param = None;
    let mut tx = None;
    let mut tx_index = None;
    let mut steps = None;
    let mut steps_index = None;
    let mut bound: Vec<String> = Vec::new();
    let mut candidates: Vec<(Ident, Span, Marker)> = Vec::new(); // (binding, type span, marker)
    for (index, input) in func.sig.inputs.iter_mut().enumerate() {
        let FnArg::Typed(param) = input else { continue };
        let marker = match take_idem_attrs(param) {
            Ok(marker) => marker,
            Err(e) => {
                errors.push(e);
                Marker::None
            }
        };
        // The engine supplies these; none is ever an argument of the action.
        let supplied = if is_ref_to(&param.ty, "Transaction", true) {
            Some("the transaction")
        } else if is_ref_to(&param.ty, "Steps", true) {
            Some("the step context")
        } else {
            None
        };
        if let (Some(what), Marker::SkipIfDefault(span)) = (supplied, marker) {
            errors.push(not_fingerprinted(span, what));
        }
        if is_ref_to(&param.ty, "Transaction", true) {
            if tx.is_some() {
                errors.push(syn::Error::new_spanned(&param.ty, "more than one transaction parameter"));
            } else if let Pat::Ident(_) = &*param.pat {
                tx = Some(((*param.pat).clone(), elide_lifetimes((*param.ty).clone())));
                tx_index = Some(index);
            } else {
                errors.push(syn::Error::new_spanned(
                    &param.pat,
                    "the transaction parameter must be a plain name, e.g. `tx`",
                ));
            }
            continue;
        }
        if is_ref_to(&param.ty, "Steps", false) {
            errors.push(syn::Error::new_spanned(
                &param.ty,
                "take the step context by `&mut`, e.g. `steps: &mut Steps<MySql>`",
            ));
            continue;
        }
        if is_ref_to(&param.ty, "Steps", true) {
            if args.steps.is_none() {
                errors.push(syn::Error::new_spanned(
                    &param.ty,
                    "a `&mut Steps` parameter is the step context of the `steps` mode: add `steps` to the attribute, \
                     e.g. `#[idempotent(key = \"...\", ttl = \"24h\", biz = \"charge\", steps)]`",
                ));
            } else if steps.is_some() {
                errors.push(syn::Error::new_spanned(&param.ty, "more than one step context parameter"));
            } else if let Pat::Ident(_) = &*param.pat {
                steps = Some(((*param.pat).clone(), elide_lifetimes((*param.ty).clone())));
                steps_index = Some(index);
            } else {
                errors.push(syn::Error::new_spanned(
                    &param.pat,
                    "the step context parameter must be a plain name, e.g. `steps`",
                ));
            }
            continue;
        }
        if engine_param.is_none()
            && args.engine.is_none()
            && is_ref_to(&param.ty, "Idem", false)
            && let Pat::Ident(p) = &*param.pat
        {
            engine_param = Some(p.ident.clone());
            if let Marker::SkipIfDefault(span) = marker {
                errors.push(not_fingerprinted(span, "the engine"));
            }
            continue;
        }
        let ty_span = param.ty.span();
        let mut names = Vec::new();
        bindings(&param.pat, &mut names);
        for name in names {
            bound.push(name.to_string());
            candidates.push((name, ty_span, marker));
        }
    }

    if let Some(word) = &args.steps {
        if let Some((_, ty)) = &tx {
            errors.push(syn::Error::new_spanned(
                ty,
                "in `steps` mode the final transaction opens after the steps, so no transaction stays open \
                 across an outside call: remove this parameter and take it from the step context, \
                 `let tx = steps.transaction().await?;`",
            ));
        }
        if steps.is_none() {
            errors.push(syn::Error::new_spanned(
                word,
                "`steps` needs the step context as a parameter, e.g. `steps: &mut idempotency::Steps<MySql>`",
            ));
        }
    }

    if let Some(word) = &args.join
        && tx.is_none()
    {
        errors.push(syn::Error::new_spanned(
            word,
            "`join` runs the body in the transaction the caller passes: add it as a parameter, \
             e.g. `tx: &mut Transaction<'_, MySql>`",
        ));
    }

    let engine: Option<Expr> = match (&args.engine, &engine_param) {
        (Some(expr), _) => Some(expr.clone()),
        (None, Some(ident)) => Some(syn::parse_quote!(#ident)),
        (None, None) => {
            errors.push(syn::Error::new_spanned(
                &func.sig.ident,
                "no engine found: add a parameter `idem: &Idem<DB>`, or write `engine = <expr>` (e.g. `engine = self.idem`)",
            ));
            None
        }
    };
    // A parameter the engine expression starts from (`app` in `app.idem`)
    // is plumbing, not an argument of the business action.
    let engine_root = args.engine.as_ref().and_then(root_ident);
    let mut fingerprinted = Vec::new();
    for (name, span, marker) in candidates {
        if Some(name.to_string()) == engine_root {
            if let Marker::SkipIfDefault(at) = marker {
                errors.push(not_fingerprinted(at, &format!("`{name}`, where the engine comes from,")));
            }
            continue;
        }
        match marker {
            Marker::Skip => {}
            Marker::None => fingerprinted.push(Fingerprinted { name, span, unless_default: false }),
            Marker::SkipIfDefault(_) => fingerprinted.push(Fingerprinted { name, span, unless_default: true }),
        }
    }

    let mut known: BTreeSet<String> = bound.iter().cloned().collect();
    if let Some(engine) = &engine_param {
        known.insert(engine.to_string());
    }
    if has_receiver {
        known.insert("self".into());
    }
    check_placeholders(&args.key.1, &args.key.0, &func.sig.ident, &bound, &known, &mut errors);
    if let Some((lit, template)) = &args.biz_no {
        check_placeholders(template, lit, &func.sig.ident, &bound, &known, &mut errors);
    }

    if let Some(mut error) = errors.pop() {
        for other in errors.into_iter().rev() {
            let mut first = other;
            first.combine(error);
            error = first;
        }
        return Err(error);
    }
    Ok(Checked {
        engine: engine.expect("an error was pushed when no engine was found"),
        tx,
        tx_index,
        steps,
        steps_index,
        fingerprinted,
        ret: ret.expect("an error was pushed when the return type was wrong"),
    })
}

fn check_placeholders(
    template: &Template,
    lit: &syn::LitStr,
    fn_name: &Ident,
    bound: &[String],
    known: &BTreeSet<String>,
    errors: &mut Vec<syn::Error>,
) {
    for root in template.roots() {
        if !known.contains(root) {
            let listed = if bound.is_empty() {
                "it has none that can be rendered".to_owned()
            } else {
                format!("its parameters are {}", bound.iter().map(|b| format!("`{b}`")).collect::<Vec<_>>().join(", "))
            };
            errors.push(syn::Error::new_spanned(
                lit,
                format!("placeholder `<{root}>` names no parameter of `{fn_name}`; {listed}"),
            ));
        }
    }
}

/// Removes `#[idem(...)]` from a parameter and says what it asked for.
fn take_idem_attrs(param: &mut PatType) -> syn::Result<Marker> {
    let mut marker = Marker::None;
    // `skip` may repeat, as it always could; `skip_if_default` may not.
    let mut skip = false;
    let mut error = None;
    param.attrs.retain(|attr| {
        if !attr.path().is_ident("idem") {
            return true;
        }
        let parsed = attr.parse_nested_meta(|meta| {
            // Only a listed option reaches its arm, as for the attribute's arguments.
            let option = PARAMETER_OPTIONS.into_iter().find(|option| meta.path.is_ident(option));
            match option {
                Some("skip") => {
                    skip = true;
                    Ok(())
                }
                Some("skip_if_default") => {
                    if let Marker::SkipIfDefault(_) = marker {
                        return Err(meta.error("duplicate parameter option `skip_if_default`"));
                    }
                    marker = Marker::SkipIfDefault(meta.path.span());
                    Ok(())
                }
                _ => {
                    Err(meta.error("unknown parameter option; expected `#[idem(skip)]` or `#[idem(skip_if_default)]`"))
                }
            }
        });
        if let Err(e) = parsed {
            error.get_or_insert(e);
        }
        false
    });
    if let Some(e) = error {
        return Err(e);
    }
    match (skip, marker) {
        (true, Marker::SkipIfDefault(span)) => Err(syn::Error::new(
            span,
            "`skip` and `skip_if_default` exclude each other: `skip` leaves the parameter out always, \
             `skip_if_default` only while it equals its `Default`; keep one",
        )),
        (true, _) => Ok(Marker::Skip),
        (false, marker) => Ok(marker),
    }
}

/// `#[idem(skip_if_default)]` on a parameter the fingerprint never holds.
fn not_fingerprinted(span: Span, what: &str) -> syn::Error {
    syn::Error::new(
        span,
        format!(
            "`skip_if_default` has nothing to leave out: {what} is never part of the fingerprint; \
             the option goes on an argument of the action, e.g. `#[idem(skip_if_default)] coupon: Option<String>`"
        ),
    )
}

fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Path(p) => p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Result"),
        Type::Group(g) => is_result(&g.elem),
        Type::Paren(p) => is_result(&p.elem),
        _ => false,
    }
}

/// `&mut ...::Transaction<..>`, `&mut ...::Steps<..>` (mutable) or `&...::Idem<..>` (shared).
pub fn is_ref_to(ty: &Type, name: &str, mutable: bool) -> bool {
    match ty {
        Type::Reference(r) if r.mutability.is_some() == mutable => match &*r.elem {
            Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == name),
            Type::Group(g) => {
                is_ref_to(&Type::Reference(syn::TypeReference { elem: g.elem.clone(), ..r.clone() }), name, mutable)
            }
            _ => false,
        },
        Type::Group(g) => is_ref_to(&g.elem, name, mutable),
        _ => false,
    }
}

/// Every name a pattern binds, e.g. `req` in `Json(req)`.
fn bindings(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => {
            if let Some((_, sub)) = &p.subpat {
                bindings(sub, out);
            }
            out.push(p.ident.clone());
        }
        Pat::TupleStruct(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Tuple(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Reference(p) => bindings(&p.pat, out),
        Pat::Slice(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Type(p) => bindings(&p.pat, out),
        _ => {}
    }
}

/// The variable an expression like `app.idem` or `self.idem` starts from.
fn root_ident(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Path(p) => p.path.get_ident().map(ToString::to_string),
        Expr::Field(f) => root_ident(&f.base),
        Expr::Reference(r) => root_ident(&r.expr),
        Expr::Paren(p) => root_ident(&p.expr),
        _ => None,
    }
}

/// `&mut Transaction<'c, DB>` becomes `&mut Transaction<'_, DB>`: inside the
/// body the transaction is the engine's, whatever the signature named it.
pub fn elide_lifetimes(mut ty: Type) -> Type {
    struct Elide;
    impl VisitMut for Elide {
        fn visit_lifetime_mut(&mut self, l: &mut syn::Lifetime) {
            *l = syn::Lifetime::new("'_", l.span());
        }
    }
    Elide.visit_type_mut(&mut ty);
    ty
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::TokenStream;
    use quote::quote;

    fn check_fn(args: TokenStream, item: TokenStream) -> syn::Result<Checked> {
        let args = crate::attr::parse(args).expect("arguments parse");
        check(&mut syn::parse2(item).expect("a fn"), &args)
    }

    fn err(args: TokenStream, item: TokenStream) -> String {
        match check_fn(args, item) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"),
        }
    }

    fn plain() -> TokenStream {
        quote!(key = "o_<order_id>", ttl = "1h", biz = "pay")
    }

    #[test]
    fn skip_if_default_marks_its_argument_only() {
        let checked = check_fn(
            plain(),
            quote! {
                async fn pay(
                    idem: &Idem<Db>,
                    tx: &mut Transaction<'_, Db>,
                    order_id: u64,
                    #[idem(skip_if_default)] coupon: Option<String>,
                    #[idem(skip)] trace: Trace,
                    #[idem(skip_if_default)] Json(extra): Json<Extra>,
                ) -> Result<u64, Error> { Ok(order_id) }
            },
        )
        .unwrap();
        let shown: Vec<(String, bool)> =
            checked.fingerprinted.iter().map(|f| (f.name.to_string(), f.unless_default)).collect();
        let expected = [("order_id", false), ("coupon", true), ("extra", true)];
        assert_eq!(shown, expected.map(|(n, u)| (n.to_owned(), u)));
    }

    #[test]
    fn skip_if_default_is_refused_where_it_cannot_apply() {
        let refused = |item: TokenStream, args: TokenStream| err(args, item);
        let on_tx = refused(
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    #[idem(skip_if_default)] tx: &mut Transaction<'_, Db>,
                    order_id: u64,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
            plain(),
        );
        assert!(on_tx.contains("nothing to leave out: the transaction is never part of the fingerprint"), "{on_tx}");
        let on_engine = refused(
            quote!(
                async fn pay(#[idem(skip_if_default)] idem: &Idem<Db>, order_id: u64) -> Result<u64, E> {
                    Ok(1)
                }
            ),
            plain(),
        );
        assert!(on_engine.contains("the engine is never part of the fingerprint"), "{on_engine}");
        let on_root = refused(
            quote!(
                async fn pay(#[idem(skip_if_default)] app: &App, order_id: u64) -> Result<u64, E> {
                    Ok(1)
                }
            ),
            quote!(key = "o_<order_id>", ttl = "1h", biz = "pay", engine = app.idem),
        );
        assert!(on_root.contains("`app`, where the engine comes from, is never part of the fingerprint"), "{on_root}");
        let on_steps = refused(
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    #[idem(skip_if_default)] steps: &mut Steps<Db>,
                    order_id: u64,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
            quote!(key = "o_<order_id>", ttl = "1h", biz = "pay", steps),
        );
        assert!(on_steps.contains("the step context is never part of the fingerprint"), "{on_steps}");
    }

    #[test]
    fn skip_if_default_is_said_once_and_never_with_skip() {
        let with_skip = err(
            plain(),
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    order_id: u64,
                    #[idem(skip, skip_if_default)] c: Option<u8>,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
        );
        assert!(with_skip.contains("`skip` and `skip_if_default` exclude each other"), "{with_skip}");
        let apart = err(
            plain(),
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    order_id: u64,
                    #[idem(skip_if_default)]
                    #[idem(skip)]
                    c: Option<u8>,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
        );
        assert!(apart.contains("exclude each other"), "{apart}");
        let twice = err(
            plain(),
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    order_id: u64,
                    #[idem(skip_if_default, skip_if_default)] c: Option<u8>,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
        );
        assert!(twice.contains("duplicate parameter option `skip_if_default`"), "{twice}");
        let unknown = err(
            plain(),
            quote!(
                async fn pay(idem: &Idem<Db>, order_id: u64, #[idem(skip_if_none)] c: Option<u8>) -> Result<u64, E> {
                    Ok(1)
                }
            ),
        );
        assert!(unknown.contains("expected `#[idem(skip)]` or `#[idem(skip_if_default)]`"), "{unknown}");
        let valued = err(
            plain(),
            quote!(
                async fn pay(
                    idem: &Idem<Db>,
                    order_id: u64,
                    #[idem(skip_if_default = true)] c: Option<u8>,
                ) -> Result<u64, E> {
                    Ok(1)
                }
            ),
        );
        assert!(valued.contains("expected `,`"), "{valued}");
    }
}
