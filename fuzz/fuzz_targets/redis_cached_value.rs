//! The values idempotency reads back from Redis: a result hash's field (`d`, the
//! record's expiry in 6 bytes, 16 bytes of fingerprint, the response) and
//! a claim's key (`p:<token>:<fingerprint>`), and at an issued token's owner key (`i:`/`u:<expires_ms>:<subject>`)
//! and live key (`<expires_ms>`). Input: the first byte picks what is
//! checked, the next eight are the clock (epoch ms); the rest is either a
//! value as Redis returns it, or what the engine writes.
//!
//! Checks: nothing panics; every value gets a verdict (none is taken for a
//! failing Redis); what the engine writes reads back identically, a live
//! result up to its expiry and nothing from then on; a value read as a
//! live result, or as a token's owner or expiry, is exactly what the
//! engine would have written for it (garbage is never misread as one).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_fuzz::alloc;
use idempotency_runtime::__fuzz::{self, Cached};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    alloc::bounded(data.len(), || check(data));
});

fn check(data: &[u8]) {
    let (Some(&mode), Some(clock)) = (data.first(), data.get(1..9)) else { return };
    let now_ms = u64::from_le_bytes(clock.try_into().expect("eight bytes"));
    let rest = &data[9..];
    match mode % 5 {
        0 => claim_value(rest, now_ms),
        1 => written_claim_values(rest, now_ms),
        2 => owner_value(rest),
        3 => live_value(rest, now_ms),
        _ => written_token_values(rest, now_ms),
    }
}

/// Any bytes the claim script hands back (a result field, or a claim).
fn claim_value(value: &[u8], now_ms: u64) {
    match __fuzz::cached_value_read(value, now_ms) {
        Cached::Finished { fingerprint_prefix, response, expires_ms } => {
            assert!(u64::try_from(expires_ms).is_ok_and(|at| at > now_ms), "{expires_ms} read live at {now_ms}");
            let written = __fuzz::cached_value_written(expires_ms, &fingerprint_prefix, &response);
            assert_eq!(written, value, "read as a live result, but not what the engine writes for it");
        }
        Cached::Running | Cached::Nothing => {}
    }
}

/// A finished call's value and a running call's claim, as the engine writes them.
fn written_claim_values(data: &[u8], now_ms: u64) {
    let mut u = Unstructured::new(data);
    let (Ok(expires_ms), Ok(digest), Ok(response)) =
        (u64::arbitrary(&mut u), <[u8; 32]>::arbitrary(&mut u), <&str>::arbitrary(&mut u))
    else {
        return;
    };
    // The engine writes an epoch-ms expiry (in 6 bytes) and a hex fingerprint.
    let expires_ms = (expires_ms % (1 << 48)).cast_signed();
    let fingerprint: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let written = __fuzz::cached_value_written(expires_ms, &fingerprint, response);
    let read = __fuzz::cached_value_read(&written, now_ms);
    if expires_ms.cast_unsigned() > now_ms {
        let fingerprint_prefix = fingerprint[..32].to_owned();
        let expected = Cached::Finished { fingerprint_prefix, response: response.into(), expires_ms };
        assert_eq!(read, expected);
    } else {
        assert_eq!(read, Cached::Nothing, "an expired result answers");
    }
    let claim = __fuzz::claim_value_written(&fingerprint);
    assert_eq!(__fuzz::cached_value_read(&claim, now_ms), Cached::Running);
}

/// Any bytes at a token's owner key.
fn owner_value(value: &[u8]) {
    match __fuzz::token_owner_read(value) {
        Ok(Some((used, expires_at_ms, subject))) => {
            let written = __fuzz::token_owner_written(used, expires_at_ms, &subject);
            assert_eq!(written, value, "read as an owner, but not what the engine writes for it");
        }
        Ok(None) => {}
        Err(e) => panic!("{value:?} left the token without a verdict: {e}"),
    }
}

/// Any bytes at a token's live key.
fn live_value(value: &[u8], now_ms: u64) {
    match __fuzz::token_live_read(value, now_ms) {
        Ok(Some(expires_at_ms)) => {
            assert!(expires_at_ms > now_ms);
            assert_eq!(expires_at_ms.to_string().as_bytes(), value, "read as an expiry it does not spell");
        }
        Ok(None) => {}
        Err(e) => panic!("{value:?} left the token without a verdict: {e}"),
    }
}

/// A token's two values, as the engine writes them.
fn written_token_values(data: &[u8], now_ms: u64) {
    let mut u = Unstructured::new(data);
    let (Ok(used), Ok(expires_at_ms), Ok(subject)) =
        (bool::arbitrary(&mut u), u64::arbitrary(&mut u), <&str>::arbitrary(&mut u))
    else {
        return;
    };
    if !idempotency_runtime::token::is_valid_subject(subject) {
        return;
    }
    let owner = __fuzz::token_owner_written(used, expires_at_ms, subject);
    assert_eq!(__fuzz::token_owner_read(&owner), Ok(Some((used, expires_at_ms, subject.to_owned()))));
    // The live key holds the expiry as Redis stores an integer argument.
    let live = expires_at_ms.to_string();
    let expected = (expires_at_ms > now_ms).then_some(expires_at_ms);
    assert_eq!(__fuzz::token_live_read(live.as_bytes(), now_ms), Ok(expected));
}
