//! Kubernetes resource quantities (`100m`, `16Mi`, `1.5`, `2e3`), read exactly.
//!
//! The gate container's resources are compared with a pod's (QoS class) and a namespace's
//! LimitRanges (min, max, ratio), so quantities are parsed, not compared as text. A value is
//! held in nano-units as an `i128`: every suffix Kubernetes accepts (`n` to `E`, `Ki` to `Ei`)
//! fits exactly; finer fractions round up, as the API server rounds quantities up.

use std::cmp::Ordering;
use std::fmt;

/// A quantity in nano-units (1 = 1e-9 of the unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantity(i128);

const NANO: i128 = 1_000_000_000;

impl Quantity {
    pub const ZERO: Quantity = Quantity(0);

    /// From whole milli-units (`Quantity::milli(100)` is `100m`).
    #[cfg(test)]
    fn milli(m: i64) -> Self {
        Quantity(i128::from(m) * 1_000_000)
    }

    /// From whole units (bytes for memory, cores for cpu).
    pub fn units(u: i64) -> Self {
        Quantity(i128::from(u) * NANO)
    }

    pub fn from_nanos(n: i128) -> Self {
        Quantity(n)
    }

    /// Rounded up to whole units (bytes).
    pub fn units_ceil(self) -> Self {
        Quantity((self.0 + NANO - 1).div_euclid(NANO) * NANO)
    }

    /// Rounded up to whole milli-units.
    pub fn milli_ceil(self) -> Self {
        Quantity((self.0 + 999_999).div_euclid(1_000_000) * 1_000_000)
    }

    pub fn nanos(self) -> i128 {
        self.0
    }

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Parses a quantity as the API server accepts it; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let (sign, rest) = match s.as_bytes().first()? {
            b'-' => (-1, &s[1..]),
            b'+' => (1, &s[1..]),
            _ => (1, s),
        };
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return None;
        }
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        // The number as digits and a power of ten.
        let digits = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 30 {
            return None;
        }
        let mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
        let mut exp10: i32 = -(frac_part.len() as i32);
        let mut binary: i128 = 1;
        match suffix {
            "" => {}
            "n" => exp10 -= 9,
            "u" => exp10 -= 6,
            "m" => exp10 -= 3,
            "k" => exp10 += 3,
            "M" => exp10 += 6,
            "G" => exp10 += 9,
            "T" => exp10 += 12,
            "P" => exp10 += 15,
            "E" => exp10 += 18,
            "Ki" => binary = 1 << 10,
            "Mi" => binary = 1 << 20,
            "Gi" => binary = 1 << 30,
            "Ti" => binary = 1 << 40,
            "Pi" => binary = 1 << 50,
            "Ei" => binary = 1 << 60,
            s if s.starts_with(['e', 'E']) => {
                let e: i32 = s[1..].parse().ok()?;
                if !(-40..=40).contains(&e) {
                    return None;
                }
                exp10 += e;
            }
            _ => return None,
        }
        // value in nanos = mantissa * binary * 10^(exp10 + 9), rounded up.
        let exp = exp10 + 9;
        let scaled = mantissa.checked_mul(binary)?;
        let value = if exp >= 0 {
            scaled.checked_mul(10i128.checked_pow(exp as u32)?)?
        } else {
            let div = 10i128.checked_pow((-exp) as u32)?;
            (scaled + div - 1) / div
        };
        Some(Quantity(sign * value))
    }

    /// `self * num / den`, rounded up.
    pub fn scale_ceil(self, num: i128, den: i128) -> Self {
        let p = self.0 * num;
        Quantity(p.div_euclid(den) + i128::from(p.rem_euclid(den) != 0))
    }

    /// Whether `limit / request` is at most `ratio` (exactly, no rounding).
    pub fn ratio_at_most(limit: Self, request: Self, ratio: Self) -> bool {
        // limit / request <= ratio / 1  <=>  limit * 1e9 <= ratio * request (all in nanos)
        (limit.0 * NANO).cmp(&(ratio.0 * request.0)) != Ordering::Greater
    }

    /// The canonical text of a cpu quantity: whole cores, else milli-cores (rounded up).
    pub fn cpu_string(self) -> String {
        if self.0 % NANO == 0 {
            (self.0 / NANO).to_string()
        } else {
            format!("{}m", (self.0 + 999_999).div_euclid(1_000_000))
        }
    }

    /// The canonical text of a memory quantity: `Mi` or `Ki` where exact, else bytes (rounded up).
    pub fn memory_string(self) -> String {
        let bytes = (self.0 + NANO - 1).div_euclid(NANO);
        if bytes != 0 && bytes % (1 << 20) == 0 {
            format!("{}Mi", bytes >> 20)
        } else if bytes != 0 && bytes % (1 << 10) == 0 {
            format!("{}Ki", bytes >> 10)
        } else {
            bytes.to_string()
        }
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}n", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap_or_else(|| panic!("{s} parses"))
    }

    #[test]
    fn parses_what_kubernetes_writes() {
        assert_eq!(q("100m"), Quantity::milli(100));
        assert_eq!(q("0.1"), Quantity::milli(100));
        assert_eq!(q(".5"), Quantity::milli(500));
        assert_eq!(q("1"), Quantity::units(1));
        assert_eq!(q("16Mi"), Quantity::units(16 << 20));
        assert_eq!(q("1.5Gi"), Quantity::units(3 << 29));
        assert_eq!(q("1e3"), Quantity::units(1000));
        assert_eq!(q("1E-3"), Quantity::milli(1));
        assert_eq!(q("128k"), Quantity::units(128_000));
        assert_eq!(q("1n"), Quantity(1));
        assert_eq!(q("0"), Quantity::ZERO);
        assert_eq!(q("-1"), Quantity::units(-1));
        assert!(q("1Gi") > q("1G"));
        for bad in ["", "m", "1.2.3", "1x", "Mi", "1 Mi", "1e400", "."] {
            assert_eq!(Quantity::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn prints_canonical_text() {
        assert_eq!(q("0.1").cpu_string(), "100m");
        assert_eq!(q("2").cpu_string(), "2");
        assert_eq!(q("1500m").cpu_string(), "1500m");
        assert_eq!(q("1u").cpu_string(), "1m", "rounded up");
        assert_eq!(q("16Mi").memory_string(), "16Mi");
        assert_eq!(q("1024").memory_string(), "1Ki");
        assert_eq!(q("1000").memory_string(), "1000");
        assert_eq!(q("1G").memory_string(), "1000000000");
    }

    #[test]
    fn ratios_and_scaling() {
        assert!(Quantity::ratio_at_most(q("100m"), q("25m"), q("4")));
        assert!(!Quantity::ratio_at_most(q("100m"), q("24m"), q("4")));
        assert_eq!(q("100m").scale_ceil(1, 3), Quantity(33_333_334));
    }
}
