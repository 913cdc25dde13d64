//! Exact decimal arithmetic: sums that either are exact or say so.
//!
//! rust_decimal keeps at most 96 bits of mantissa (about 28 significant digits). When
//! a result needs more, its `+` panics on overflow and, short of overflow, silently
//! rounds by lowering the scale. Neither is acceptable for a ledger or a usage fold,
//! so every stored quantity is added with [`exact_add`], which returns `None` instead
//! of a rounded or overflowed value.

use rust_decimal::Decimal;

/// `a + b` when it is representable exactly; `None` on overflow or when the result
/// would have to be rounded.
///
/// Why the scale test is exact: rust_decimal adds by bringing both operands to the
/// larger scale and lowers the result's scale only when the mantissa does not fit,
/// which is precisely when it rounds. A result that kept the larger scale is exact.
/// Adding zero is the exception: rust_decimal returns the other operand as it is.
pub fn exact_add(a: Decimal, b: Decimal) -> Option<Decimal> {
    let sum = a.checked_add(b)?;
    (a.is_zero() || b.is_zero() || sum.scale() >= a.scale().max(b.scale())).then_some(sum)
}

/// `a * n` when it is representable exactly; `None` on overflow or rounding.
/// rust_decimal keeps the scale of `a` for an integer factor unless the mantissa
/// does not fit, exactly when it would round.
pub fn exact_mul_int(a: Decimal, n: i64) -> Option<Decimal> {
    let product = a.checked_mul(Decimal::from(n))?;
    (a.is_zero() || n == 0 || product.scale() >= a.scale()).then_some(product)
}

/// The exact sum of `values`, or `None` when any partial sum is not exact.
pub fn exact_sum(values: impl IntoIterator<Item = Decimal>) -> Option<Decimal> {
    values.into_iter().try_fold(Decimal::ZERO, exact_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::str::FromStr;

    #[test]
    fn overflow_and_rounding_are_refused() {
        assert_eq!(exact_add(Decimal::MAX, Decimal::ONE), None);
        assert_eq!(exact_add(Decimal::MIN, -Decimal::ONE), None);
        // 1e11 + 1e-18 needs 30 significant digits: rust_decimal rounds it away.
        let big = Decimal::from_str("100000000000").unwrap();
        let tiny = Decimal::from_str("0.000000000000000001").unwrap();
        assert_eq!(
            big.checked_add(tiny),
            Some(big),
            "rust_decimal rounds silently"
        );
        assert_eq!(exact_add(big, tiny), None);
        // One digit less fits (1e28 + 1 < 2^96).
        let smaller = Decimal::from_str("10000000000").unwrap();
        assert_eq!(
            exact_add(smaller, tiny).unwrap().to_string(),
            "10000000000.000000000000000001"
        );
        assert_eq!(
            exact_sum([Decimal::ONE, Decimal::TWO, -Decimal::TEN]),
            Some(Decimal::from(-7))
        );
    }

    proptest! {
        /// Sums well inside 28 digits are always answered (no false refusals).
        #[test]
        fn small_sums_are_answered(
            a in -1_000_000_000_000i64..1_000_000_000_000, sa in 0u32..=12,
            b in -1_000_000_000_000i64..1_000_000_000_000, sb in 0u32..=12,
        ) {
            let x = Decimal::new(a, sa);
            let y = Decimal::new(b, sb);
            prop_assert!(exact_add(x, y).is_some(), "{} + {}", x, y);
        }

        /// Whenever exact_add answers, the answer is the true sum: checked by
        /// subtracting back in i128 arithmetic on a common scale.
        #[test]
        fn answers_are_true_sums(
            a in any::<i64>(), sa in 0u32..=28, b in any::<i64>(), sb in 0u32..=28,
            wide in any::<bool>()
        ) {
            let widen = |m: i64, scale: u32| {
                let mantissa = if wide { m as i128 * 1_000_000_000_000 } else { m as i128 };
                Decimal::try_from_i128_with_scale(mantissa, scale).ok()
            };
            let (Some(x), Some(y)) = (widen(a, sa), widen(b, sb)) else {
                return Ok(());
            };
            if let Some(sum) = exact_add(x, y) {
                let scale = sum.scale();
                let at = |d: Decimal| {
                    10i128
                        .checked_pow(scale - d.scale())
                        .and_then(|factor| d.mantissa().checked_mul(factor))
                };
                if let (Some(sx), Some(sy)) = (at(x), at(y)) {
                    prop_assert_eq!(Some(sum.mantissa()), sx.checked_add(sy));
                }
            }
        }
    }
}
