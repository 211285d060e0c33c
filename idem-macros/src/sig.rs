//! Checks the annotated fn against the arguments: async, returns `Result`,
//! has an engine, and every placeholder names one of its parameters. Finds
//! the transaction parameter (supplied by the engine), or in `steps` mode
//! the step context, and the parameters that go into the fingerprint.

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
    pub fingerprinted: Vec<(Ident, Span)>,
    /// The declared return type.
    pub ret: Type,
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
    let mut candidates: Vec<(Ident, Span, bool)> = Vec::new(); // (binding, type span, skipped)
    for (index, input) in func.sig.inputs.iter_mut().enumerate() {
        let FnArg::Typed(param) = input else { continue };
        let skipped = match take_idem_attrs(param) {
            Ok(skip) => skip,
            Err(e) => {
                errors.push(e);
                false
            }
        };
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
            continue;
        }
        let ty_span = param.ty.span();
        let mut names = Vec::new();
        bindings(&param.pat, &mut names);
        for name in names {
            bound.push(name.to_string());
            candidates.push((name, ty_span, skipped));
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
                "`steps` needs the step context as a parameter, e.g. `steps: &mut idem::Steps<MySql>`",
            ));
        }
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
    let fingerprinted = candidates
        .into_iter()
        .filter(|(name, _, skipped)| !skipped && Some(name.to_string()) != engine_root)
        .map(|(name, span, _)| (name, span))
        .collect();

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

/// Removes `#[idem(...)]` from a parameter; `Ok(true)` when it said `skip`.
fn take_idem_attrs(param: &mut PatType) -> syn::Result<bool> {
    let mut skip = false;
    let mut error = None;
    param.attrs.retain(|attr| {
        if !attr.path().is_ident("idem") {
            return true;
        }
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                skip = true;
                Ok(())
            } else {
                Err(meta.error("unknown parameter option; expected `#[idem(skip)]`"))
            }
        });
        if let Err(e) = parsed {
            error = Some(e);
        }
        false
    });
    match error {
        Some(e) => Err(e),
        None => Ok(skip),
    }
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
fn is_ref_to(ty: &Type, name: &str, mutable: bool) -> bool {
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
fn elide_lifetimes(mut ty: Type) -> Type {
    struct Elide;
    impl VisitMut for Elide {
        fn visit_lifetime_mut(&mut self, l: &mut syn::Lifetime) {
            *l = syn::Lifetime::new("'_", l.span());
        }
    }
    Elide.visit_type_mut(&mut ty);
    ty
}
