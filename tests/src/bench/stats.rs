//! Order statistics over a handful of rounds or a few hundred timings.

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
}
