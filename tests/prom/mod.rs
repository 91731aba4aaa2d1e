//! Reading the Prometheus text format a scrape of `/metrics` returns.
#![allow(dead_code)]

/// One scrape of `/metrics` in the Prometheus text format.
pub struct Metrics(pub String);

impl Metrics {
    /// The value of the sample `name` whose labels include every `labels`
    /// pair; `None` when there is no such sample.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (n, rest) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                if n != name {
                    return None;
                }
                let have: Vec<(&str, &str)> = rest
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k, v.trim_matches('"')))
                    .collect();
                labels
                    .iter()
                    .all(|want| have.contains(want))
                    .then(|| value.parse().ok())?
            })
    }

    /// Like [`Metrics::get`], 0 when absent (a counter not yet incremented).
    pub fn count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }
}
