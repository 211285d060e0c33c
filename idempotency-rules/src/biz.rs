//! The business action (`biz`) and the business number (`biz_no`).

/// Longest `biz`: the `biz_type` column is `VARCHAR(32)`.
pub const MAX_BIZ_LEN: usize = 32;
/// Longest rendered `biz_no`: the column is `VARCHAR(64)`.
pub const MAX_BIZ_NO_LEN: usize = 64;

/// `true` when `biz` matches `[a-z0-9_]{1,32}`. Without `:`, a `biz` and
/// the key after it can never run together into another pair's Redis key.
pub fn is_valid_biz(biz: &str) -> bool {
    (1..=MAX_BIZ_LEN).contains(&biz.len())
        && biz.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn biz_names_are_lower_case_words() {
        for good in ["pay", "order_refund", "v2", &"a".repeat(MAX_BIZ_LEN)] {
            assert!(is_valid_biz(good), "{good:?}");
        }
        for bad in ["", "Pay", "a:b", "a-b", "a.b", "a b", "café", &"a".repeat(MAX_BIZ_LEN + 1)] {
            assert!(!is_valid_biz(bad), "{bad:?}");
        }
    }
}
