//! The percentiles every benchmark table reports, in milliseconds.

use std::time::Duration;

/// The `p`th percentile (0–100, nearest rank) of `sorted`, in milliseconds; NaN when empty.
pub fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_in_milliseconds() {
        let ms = |n: u64| Duration::from_millis(n);
        let sorted = [ms(1), ms(2), ms(3), ms(4), ms(5)];
        assert_eq!(percentile(&sorted, 50.0), 3.0);
        assert_eq!(percentile(&sorted, 99.0), 5.0);
        assert_eq!(percentile(&sorted, 0.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
