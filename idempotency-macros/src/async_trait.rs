//! Copes with a method `#[async_trait]` has already expanded. That
//! attribute sits on the impl, so it runs first and hands `#[idempotent]` a
//! plain fn returning a boxed future. As tracing's `#[instrument]` does,
//! the future inside is what gets rewritten, and the boxed signature stays,
//! so the method still matches the trait's declaration.
//!
//! Input, from `async fn pay(&self, tx: &mut Transaction<'_, MySql>, order_id: u64) -> Result<R, E>`:
//!
//! ```ignore
//! fn pay<'life0, 'life1, 'life2, 'async_trait>(
//!     &'life0 self,
//!     tx: &'life1 mut Transaction<'life2, MySql>,
//!     order_id: u64,
//! ) -> Pin<Box<dyn Future<Output = Result<R, E>> + Send + 'async_trait>>
//! where 'life0: 'async_trait, 'life1: 'async_trait, 'life2: 'async_trait, Self: 'async_trait
//! {
//!     Box::pin(async move { let __self = self; let order_id = order_id; /* the body */ })
//! }
//! ```
//!
//! [`unbox`] turns it into `async fn pay<..>(..) -> Result<R, E> { let __self = self; .. }` for
//! the usual pipeline; [`rebox`] wraps the rewritten body back,
//! `{ ::std::boxed::Box::pin(async move { .. }) }`, under the boxed return
//! type, and drops the lifetimes that only a removed parameter named
//! (`'life1`, `'life2` above: the trait declares no transaction, so its
//! method has none of them).

use std::collections::BTreeSet;

use syn::visit_mut::VisitMut;
use syn::{
    Block, Expr, GenericArgument, GenericParam, ItemFn, Lifetime, PathArguments, ReturnType, Signature, Stmt, Token,
    Type, TypeParamBound, WherePredicate,
};

/// What [`unbox`] took off: the boxed return type.
pub struct Boxed {
    output: ReturnType,
}

/// Makes async-trait's expansion of a method an `async fn` again, or
/// leaves any other fn alone (`None`).
pub fn unbox(func: &mut ItemFn) -> Option<Boxed> {
    if func.sig.asyncness.is_some() {
        return None;
    }
    let ReturnType::Type(arrow, ty) = &func.sig.output else { return None };
    let output = ReturnType::Type(*arrow, Box::new(future_output(ty)?.clone()));
    let inner = boxed_async_block(&func.block)?.clone();
    let boxed = Boxed { output: std::mem::replace(&mut func.sig.output, output) };
    func.sig.asyncness = Some(Token![async](func.sig.fn_token.span));
    *func.block = inner;
    Some(boxed)
}

/// Puts the boxed signature back around the rewritten body.
pub fn rebox(func: &mut ItemFn, boxed: Boxed) {
    func.sig.asyncness = None;
    func.sig.output = boxed.output;
    let body = &func.block;
    func.block = syn::parse_quote!({ ::std::boxed::Box::pin(async move #body) });
    drop_unnamed_lifetimes(&mut func.sig);
}

/// `R` in `Pin<Box<dyn Future<Output = R> + ..>>`, whatever paths lead to
/// `Pin`, `Box` and `Future` (`::core::pin::Pin`, `std::boxed::Box`).
fn future_output(ty: &Type) -> Option<&Type> {
    let boxed = only_argument(ty, "Pin")?;
    let Type::TraitObject(object) = ungroup(only_argument(boxed, "Box")?) else { return None };
    object.bounds.iter().find_map(|bound| {
        let TypeParamBound::Trait(bound) = bound else { return None };
        let future = bound.path.segments.last().filter(|s| s.ident == "Future")?;
        let PathArguments::AngleBracketed(arguments) = &future.arguments else { return None };
        arguments.args.iter().find_map(|argument| match argument {
            GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&assoc.ty),
            _ => None,
        })
    })
}

/// The one type argument of `name<T>` (the path's last segment).
fn only_argument<'t>(ty: &'t Type, name: &str) -> Option<&'t Type> {
    let Type::Path(path) = ungroup(ty) else { return None };
    let segment = path.path.segments.last().filter(|s| s.ident == name)?;
    let PathArguments::AngleBracketed(arguments) = &segment.arguments else { return None };
    match arguments.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(inner)] => Some(inner),
        _ => None,
    }
}

fn ungroup(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => ungroup(&group.elem),
        Type::Paren(paren) => ungroup(&paren.elem),
        other => other,
    }
}

/// The block of `async move { .. }` when `block` is nothing but
/// `Box::pin(async move { .. })`.
fn boxed_async_block(block: &Block) -> Option<&Block> {
    let [Stmt::Expr(Expr::Call(call), None)] = block.stmts.as_slice() else { return None };
    let Expr::Path(function) = &*call.func else { return None };
    let names: Vec<String> = function.path.segments.iter().map(|s| s.ident.to_string()).collect();
    if !names.ends_with(&["Box".to_owned(), "pin".to_owned()]) {
        return None;
    }
    match call.args.iter().collect::<Vec<_>>().as_slice() {
        [Expr::Async(future)] if future.capture.is_some() => Some(&future.block),
        _ => None,
    }
}

/// Removes the lifetime parameters the signature no longer names (those
/// of a parameter the engine now supplies) and their `'l: ..` bounds.
fn drop_unnamed_lifetimes(sig: &mut Signature) {
    struct Named(BTreeSet<String>);
    impl VisitMut for Named {
        fn visit_lifetime_mut(&mut self, lifetime: &mut Lifetime) {
            self.0.insert(lifetime.ident.to_string());
        }
    }
    let mut named = Named(BTreeSet::new());
    let mut seen = sig.clone();
    for input in &mut seen.inputs {
        named.visit_fn_arg_mut(input);
    }
    named.visit_return_type_mut(&mut seen.output);
    // A lifetime bounded in the where clause is not named by that alone;
    // one that bounds something else is.
    for predicate in seen.generics.where_clause.iter_mut().flat_map(|w| w.predicates.iter_mut()) {
        match predicate {
            WherePredicate::Lifetime(bounded) => bounded.bounds.iter_mut().for_each(|l| named.visit_lifetime_mut(l)),
            other => named.visit_where_predicate_mut(other),
        }
    }
    let unnamed = |lifetime: &Lifetime| !named.0.contains(&lifetime.ident.to_string());
    sig.generics.params = std::mem::take(&mut sig.generics.params)
        .into_iter()
        .filter(|param| !matches!(param, GenericParam::Lifetime(l) if unnamed(&l.lifetime)))
        .collect();
    if let Some(clause) = &mut sig.generics.where_clause {
        clause.predicates = std::mem::take(&mut clause.predicates)
            .into_iter()
            .filter(|predicate| !matches!(predicate, WherePredicate::Lifetime(l) if unnamed(&l.lifetime)))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use quote::ToTokens;

    use super::*;

    fn expanded_by_async_trait() -> ItemFn {
        syn::parse_quote! {
            fn pay<'life0, 'life1, 'life2, 'async_trait>(
                &'life0 self,
                tx: &'life1 mut Transaction<'life2, Db>,
                order_id: u64,
            ) -> ::core::pin::Pin<Box<dyn ::core::future::Future<Output = Result<u64, E>> + ::core::marker::Send + 'async_trait>>
            where
                'life0: 'async_trait,
                'life1: 'async_trait,
                'life2: 'async_trait,
                Self: 'async_trait,
            {
                Box::pin(async move {
                    let __self = self;
                    let order_id = order_id;
                    let __ret: Result<u64, E> = { Ok(order_id) };
                    __ret
                })
            }
        }
    }

    fn shown(tokens: impl ToTokens) -> String {
        tokens.to_token_stream().to_string()
    }

    #[test]
    fn unboxes_async_traits_method_and_boxes_it_back() {
        let mut func = expanded_by_async_trait();
        let boxed = unbox(&mut func).expect("recognised");
        assert!(func.sig.asyncness.is_some());
        assert_eq!(shown(&func.sig.output), "-> Result < u64 , E >");
        assert!(shown(&func.block).starts_with("{ let __self = self ;"), "{}", shown(&func.block));

        // The engine took the transaction: its lifetimes go with it.
        func.sig.inputs = func.sig.inputs.into_iter().filter(|i| !shown(i).starts_with("tx")).collect();
        rebox(&mut func, boxed);
        assert!(func.sig.asyncness.is_none());
        assert_eq!(shown(&func.sig.generics.params), "'life0 , 'async_trait");
        let clause = shown(&func.sig.generics.where_clause);
        assert_eq!(clause, "where 'life0 : 'async_trait , Self : 'async_trait");
        assert!(shown(&func.sig.output).contains("Pin < Box < dyn :: core :: future :: Future"));
        assert!(shown(&func.block).starts_with("{ :: std :: boxed :: Box :: pin (async move {"));
    }

    #[test]
    fn leaves_every_other_fn_alone() {
        let others: [ItemFn; 4] = [
            syn::parse_quote!(
                async fn pay(order_id: u64) -> Result<u64, E> {
                    Ok(order_id)
                }
            ),
            syn::parse_quote!(
                fn pay(order_id: u64) -> Result<u64, E> {
                    Ok(order_id)
                }
            ),
            // A boxed future, but built otherwise.
            syn::parse_quote!(
                fn pay() -> Pin<Box<dyn Future<Output = Result<u64, E>> + Send>> {
                    Box::pin(ready(Ok(1)))
                }
            ),
            syn::parse_quote!(
                fn pay() -> Pin<Box<dyn Future<Output = Result<u64, E>>>> {
                    let f = async move { Ok(1) };
                    Box::pin(f)
                }
            ),
        ];
        for mut func in others {
            let before = shown(&func);
            assert!(unbox(&mut func).is_none(), "{before}");
            assert_eq!(shown(&func), before);
        }
    }

    #[test]
    fn keeps_lifetimes_still_named() {
        let mut func: ItemFn = syn::parse_quote! {
            fn f<'a, 'b, 'c, 'd>(x: &'a str) -> Pin<Box<dyn Future<Output = Result<&'a str, E>> + 'd>>
            where 'b: 'd, 'c: 'd, T: 'c
            { Box::pin(async move { Ok(x) }) }
        };
        let boxed = unbox(&mut func).unwrap();
        rebox(&mut func, boxed);
        // `'b` is only bounded: dropped; `'c` bounds `T`: kept.
        assert_eq!(shown(&func.sig.generics.params), "'a , 'c , 'd");
        assert_eq!(shown(&func.sig.generics.where_clause), "where 'c : 'd , T : 'c");
    }
}
