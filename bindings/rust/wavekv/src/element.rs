use wavekv_sys as sys;

/// The engine's storage dtype: the element type of K, V, q and outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32 (`WKV_DTYPE_F32`), element type `f32`.
    F32,
    /// IEEE binary16 (`WKV_DTYPE_F16`), element type [`F16`].
    F16,
    /// bfloat16 (`WKV_DTYPE_BF16`), element type [`Bf16`].
    Bf16,
}

impl Dtype {
    /// The `WKV_DTYPE_*` value.
    pub fn raw(self) -> u32 {
        match self {
            Dtype::F32 => sys::WKV_DTYPE_F32,
            Dtype::F16 => sys::WKV_DTYPE_F16,
            Dtype::Bf16 => sys::WKV_DTYPE_BF16,
        }
    }

    /// The dtype of a `WKV_DTYPE_*` value; `None` for one this binding does
    /// not know.
    pub fn from_raw(raw: u32) -> Option<Dtype> {
        match raw {
            sys::WKV_DTYPE_F32 => Some(Dtype::F32),
            sys::WKV_DTYPE_F16 => Some(Dtype::F16),
            sys::WKV_DTYPE_BF16 => Some(Dtype::Bf16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// An IEEE binary16 value, stored as its bits.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// A bfloat16 value, stored as its bits.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl F16 {
    /// Rounds to the nearest binary16 value (ties to even); overflow gives
    /// infinity, NaN stays NaN.
    pub fn from_f32(x: f32) -> F16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32;
        let man = b & 0x7f_ffff;
        if exp == 0xff {
            let nan = if man != 0 {
                0x200 | (man >> 13) as u16
            } else {
                0
            };
            return F16(sign | 0x7c00 | nan);
        }
        let e = exp - 127 + 15;
        if e >= 0x1f {
            return F16(sign | 0x7c00);
        }
        if e <= 0 {
            // A subnormal result: shift the significand, implicit bit included.
            if e < -10 {
                return F16(sign);
            }
            let m = man | 0x80_0000;
            let shift = (14 - e) as u32;
            let half = 1u32 << (shift - 1);
            let rest = m & ((1u32 << shift) - 1);
            let mut h = (m >> shift) as u16;
            if rest > half || (rest == half && h & 1 == 1) {
                h += 1;
            }
            return F16(sign | h);
        }
        // A carry out of the significand rounds up into the exponent, and
        // from the largest finite value into infinity, as it should.
        let mut h = (((e as u32) << 10) | (man >> 13)) as u16;
        let rest = man & 0x1fff;
        if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
            h += 1;
        }
        F16(sign | h)
    }

    /// The exact f32 value.
    pub fn to_f32(self) -> f32 {
        let h = self.0;
        let sign = ((h & 0x8000) as u32) << 16;
        let exp = ((h >> 10) & 0x1f) as u32;
        let man = (h & 0x3ff) as u32;
        let bits = if exp == 0 {
            if man == 0 {
                sign
            } else {
                let mut e = 127 - 14;
                let mut m = man;
                while m & 0x400 == 0 {
                    m <<= 1;
                    e -= 1;
                }
                sign | (e << 23) | ((m & 0x3ff) << 13)
            }
        } else if exp == 0x1f {
            sign | 0x7f80_0000 | (man << 13)
        } else {
            sign | ((exp + 127 - 15) << 23) | (man << 13)
        };
        f32::from_bits(bits)
    }
}

impl Bf16 {
    /// Rounds to the nearest bfloat16 value (ties to even); NaN stays NaN.
    pub fn from_f32(x: f32) -> Bf16 {
        let b = x.to_bits();
        if x.is_nan() {
            return Bf16(((b >> 16) as u16) | 0x40);
        }
        let round = 0x7fff + ((b >> 16) & 1);
        Bf16((b.wrapping_add(round) >> 16) as u16)
    }

    /// The exact f32 value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Bf16 {}
}

/// An element type of tensors: `f32`, [`F16`] or [`Bf16`]. A call with a
/// tensor of another dtype than the engine's is refused with
/// [`Status::InvalidArgument`](crate::Status::InvalidArgument).
pub trait Element: Copy + Default + sealed::Sealed + Send + Sync + 'static {
    /// The dtype whose elements these are.
    const DTYPE: Dtype;
    /// Converts to f32 (exactly).
    fn to_f32(self) -> f32;
    /// Converts from f32, rounding to nearest.
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
}

impl Element for F16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f32(self) -> f32 {
        F16::to_f32(self)
    }
    fn from_f32(x: f32) -> F16 {
        F16::from_f32(x)
    }
}

impl Element for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Bf16 {
        Bf16::from_f32(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_every_finite_value() {
        for bits in 0..=u16::MAX {
            let h = F16(bits);
            let x = h.to_f32();
            if x.is_nan() {
                assert!(F16::from_f32(x).to_f32().is_nan());
            } else {
                assert_eq!(F16::from_f32(x), h, "bits {:#06x} -> {}", bits, x);
            }
        }
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        assert_eq!(F16::from_f32(1.0).0, 0x3c00);
        assert_eq!(F16::from_f32(-2.0).0, 0xc000);
        assert_eq!(F16::from_f32(65504.0).0, 0x7bff);
        assert_eq!(F16::from_f32(65520.0).0, 0x7c00); // halfway to 2^16: infinity
        assert_eq!(F16::from_f32(1.0 + 1.0 / 2048.0).0, 0x3c00); // tie, to even
        assert_eq!(F16::from_f32(1.0 + 3.0 / 2048.0).0, 0x3c02); // tie, to even
        assert_eq!(F16::from_f32(5.960_464_5e-8).0, 0x0001); // smallest subnormal
        assert_eq!(F16::from_f32(2.0e-8).0, 0x0000);
        assert_eq!(F16::from_f32(1e9).0, 0x7c00);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8000)).0, 0x3f80); // tie, to even
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f81_8000)).0, 0x3f82); // tie, to even
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8001)).0, 0x3f81);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16(0xc040).to_f32(), -3.0);
    }
}
