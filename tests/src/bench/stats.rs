//! Order statistics over a handful of rounds or a few hundred timings, and bootstrap intervals
//! of their medians.

/// The median (mean of the two middle values for an even count); None when empty. NaNs are
/// ignored.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// Percentile `p` (0-100) by linear interpolation between closest ranks; None when empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (s.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(s[lo] + (s[hi] - s[lo]) * frac)
}

pub fn min(v: &[f64]) -> Option<f64> {
    v.iter().copied().filter(|x| !x.is_nan()).reduce(f64::min)
}

pub fn max(v: &[f64]) -> Option<f64> {
    v.iter().copied().filter(|x| !x.is_nan()).reduce(f64::max)
}

/// (max - min) / median, the spread of the rounds relative to their median.
pub fn rel_spread(v: &[f64]) -> Option<f64> {
    let m = median(v)?;
    if m == 0.0 {
        return None;
    }
    Some((max(v)? - min(v)?) / m.abs())
}

/// Resamples behind every interval of the report.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;
/// Fixed, so that the same rounds always give the same interval and a rerun of the report
/// generator cannot move a verdict.
pub const BOOTSTRAP_SEED: u64 = 0x5eed_51de_57e9_0001;

/// SplitMix64 (Steele, Lea and Flood): enough randomness for resampling indices, and no
/// dependency for it.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is about n / 2^32, nothing at a handful of
    /// rounds).
    fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }
}

/// Percentile-bootstrap confidence interval of the median at `level` (e.g. 0.95): `resamples`
/// resamples of `v` with replacement, the median of each, and the `(1-level)/2` and
/// `(1+level)/2` percentiles of those medians. None when `v` has no number.
pub fn bootstrap_median_ci(
    v: &[f64],
    level: f64,
    resamples: usize,
    seed: u64,
) -> Option<(f64, f64)> {
    let s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() || resamples == 0 {
        return None;
    }
    let mut rng = SplitMix64(seed);
    let mut draw = vec![0.0; s.len()];
    let medians: Vec<f64> = (0..resamples)
        .map(|_| {
            for d in &mut draw {
                *d = s[rng.below(s.len())];
            }
            median(&draw).expect("non-empty resample")
        })
        .collect();
    let tail = 100.0 * (1.0 - level.clamp(0.0, 1.0)) / 2.0;
    Some((
        percentile(&medians, tail)?,
        percentile(&medians, 100.0 - tail)?,
    ))
}

/// The report's interval: 95%, [`BOOTSTRAP_RESAMPLES`], [`BOOTSTRAP_SEED`].
pub fn median_ci(v: &[f64]) -> Option<(f64, f64)> {
    bootstrap_median_ci(v, 0.95, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
}

/// Whether two closed intervals share a point.
pub fn overlap(a: (f64, f64), b: (f64, f64)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_percentiles() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 100.0), Some(5.0));
        assert_eq!(percentile(&[1.0, 2.0], 50.0), Some(1.5));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(rel_spread(&[9.0, 10.0, 11.0]), Some(0.2));
    }

    #[test]
    fn bootstrap_is_deterministic_and_brackets_the_median() {
        let v = [5650.0, 5912.0, 6020.0, 2500.0, 5900.0, 5800.0, 2600.0];
        let ci = median_ci(&v).unwrap();
        assert_eq!(median_ci(&v), Some(ci), "fixed seed, same interval");
        let m = median(&v).unwrap();
        assert!(ci.0 <= m && m <= ci.1, "{ci:?} must hold the median {m}");
        assert!(
            ci.0 >= 2500.0 && ci.1 <= 6020.0,
            "{ci:?} within the samples"
        );
        // A bimodal series has a wide interval, reaching down to the slow mode's neighbours.
        assert!(ci.0 < 5650.0, "{ci:?}");
        // Another seed draws other resamples but still brackets the median.
        let other = bootstrap_median_ci(&v, 0.95, 2000, 7).unwrap();
        assert!(other.0 <= m && m <= other.1);
        assert_eq!(median_ci(&[3.0, 3.0, 3.0]), Some((3.0, 3.0)));
        assert_eq!(median_ci(&[4.0]), Some((4.0, 4.0)));
        assert_eq!(median_ci(&[]), None);
        assert_eq!(median_ci(&[f64::NAN]), None);
    }

    #[test]
    fn bootstrap_overlap() {
        let a = median_ci(&[100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 99.8]).unwrap();
        let b = median_ci(&[150.0, 151.0, 149.0, 150.5, 149.5, 150.2, 149.8]).unwrap();
        assert!(!overlap(a, b) && !overlap(b, a), "{a:?} {b:?}");
        let c = median_ci(&[95.0, 130.0, 101.0, 99.0, 140.0, 100.0, 103.0]).unwrap();
        assert!(overlap(a, c) && overlap(c, a), "{a:?} {c:?}");
        assert!(overlap((1.0, 2.0), (2.0, 3.0)));
        assert!(!overlap((1.0, 2.0), (2.5, 3.0)));
        // The generator covers its range: every index of a small range comes up.
        let mut rng = SplitMix64(1);
        let mut seen = [false; 7];
        for _ in 0..200 {
            seen[rng.below(7)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
