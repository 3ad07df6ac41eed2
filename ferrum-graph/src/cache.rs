//! A cache of captured graphs keyed by what they reference.
//!
//! A captured graph bakes in raw device addresses (the KV cache of a sequence, its activations,
//! its step parameters). The cache key must therefore name every buffer whose address the graph
//! uses (for example the sequence's cache-buffer pointers plus the dtype): a lookup with the same
//! key replays the existing graph, a new key (new buffers) captures a new one. Evict entries
//! ([`GraphCache::invalidate`], [`GraphCache::retain`]) **before** freeing the buffers they
//! reference.
//!
//! The cache is generic over the stored graph (`G`), so its policy is tested without a GPU; with
//! the `cuda` feature, `GraphCache<K, CapturedGraph>` (alias `DecodeGraphCache<K>`) gains
//! `get_or_capture` / `replay_or_capture`, which capture on a miss.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;
use std::hash::Hash;

/// Counters of a [`GraphCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found a graph.
    pub hits: u64,
    /// Graphs made (misses that succeeded).
    pub captures: u64,
    /// Misses whose capture failed.
    pub failures: u64,
    /// Graphs dropped to stay within capacity.
    pub evictions: u64,
}

#[derive(Debug)]
struct Entry<G> {
    graph: G,
    last_used: u64,
}

/// Graphs by key, at most `capacity` of them (least recently used evicted first).
#[derive(Debug)]
pub struct GraphCache<K, G> {
    map: HashMap<K, Entry<G>>,
    capacity: usize,
    tick: u64,
    stats: CacheStats,
}

impl<K: Hash + Eq + Clone, G> GraphCache<K, G> {
    /// An empty cache holding at most `capacity` graphs (at least 1).
    pub fn new(capacity: usize) -> Self {
        GraphCache { map: HashMap::new(), capacity: capacity.max(1), tick: 0, stats: CacheStats::default() }
    }

    /// The graph for `key`, made by `make` on a miss. `make` runs only when no graph for `key`
    /// exists; if it fails nothing is stored and its error is returned. On a miss at capacity,
    /// the least recently used graph is dropped *before* `make` runs (freeing its resources
    /// first).
    pub fn get_or_try_insert_with<E>(&mut self, key: K, make: impl FnOnce() -> Result<G, E>) -> Result<&G, E> {
        self.tick += 1;
        let tick = self.tick;
        if !self.map.contains_key(&key) {
            while self.map.len() >= self.capacity && self.evict_lru() {}
        }
        let entry = match self.map.entry(key) {
            MapEntry::Occupied(o) => {
                self.stats.hits += 1;
                o.into_mut()
            }
            MapEntry::Vacant(v) => match make() {
                Ok(graph) => {
                    self.stats.captures += 1;
                    v.insert(Entry { graph, last_used: tick })
                }
                Err(e) => {
                    self.stats.failures += 1;
                    return Err(e);
                }
            },
        };
        entry.last_used = tick;
        Ok(&entry.graph)
    }

    /// Drops the least recently used graph; false when empty.
    fn evict_lru(&mut self) -> bool {
        let oldest = self.map.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone());
        match oldest {
            Some(k) => {
                self.map.remove(&k);
                self.stats.evictions += 1;
                true
            }
            None => false,
        }
    }

    /// The graph for `key`, if cached (counts as a use).
    pub fn get(&mut self, key: &K) -> Option<&G> {
        self.tick += 1;
        let tick = self.tick;
        let e = self.map.get_mut(key)?;
        e.last_used = tick;
        self.stats.hits += 1;
        Some(&e.graph)
    }

    /// True when a graph for `key` is cached (not a use).
    pub fn contains(&self, key: &K) -> bool {
        self.map.contains_key(key)
    }

    /// Removes and returns the graph for `key` (call before freeing the buffers it references).
    pub fn invalidate(&mut self, key: &K) -> Option<G> {
        self.map.remove(key).map(|e| e.graph)
    }

    /// Keeps only the graphs whose key satisfies `keep` (e.g. drop every graph of a released
    /// sequence).
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.map.retain(|k, _| keep(k));
    }

    /// Drops every graph.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Number of cached graphs.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no graph is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Maximum number of graphs.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Hit / capture / eviction counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_once_per_key_and_replays_hits() {
        let mut c: GraphCache<(Vec<u64>, u8), String> = GraphCache::new(4);
        let mut made = 0;
        for _ in 0..3 {
            let g = c
                .get_or_try_insert_with((vec![0x1000, 0x2000], 1), || {
                    made += 1;
                    Ok::<_, ()>("graph A".to_string())
                })
                .unwrap();
            assert_eq!(g, "graph A");
        }
        assert_eq!(made, 1);
        // Other buffers (or another dtype): a new capture.
        c.get_or_try_insert_with((vec![0x1000, 0x3000], 1), || Ok::<_, ()>("graph B".into())).unwrap();
        c.get_or_try_insert_with((vec![0x1000, 0x2000], 2), || Ok::<_, ()>("graph C".into())).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.stats(), CacheStats { hits: 2, captures: 3, failures: 0, evictions: 0 });
    }

    #[test]
    fn failed_capture_stores_nothing() {
        let mut c: GraphCache<u32, u32> = GraphCache::new(2);
        assert_eq!(c.get_or_try_insert_with(1, || Err("boom")), Err("boom"));
        assert!(c.is_empty());
        assert_eq!(c.stats().failures, 1);
        assert_eq!(*c.get_or_try_insert_with(1, || Ok::<_, &str>(10)).unwrap(), 10);
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut c: GraphCache<u32, u32> = GraphCache::new(2);
        c.get_or_try_insert_with(1, || Ok::<_, ()>(10)).unwrap();
        c.get_or_try_insert_with(2, || Ok::<_, ()>(20)).unwrap();
        assert_eq!(c.get(&1), Some(&10)); // 1 is now more recent than 2
        c.get_or_try_insert_with(3, || Ok::<_, ()>(30)).unwrap();
        assert!(c.contains(&1) && !c.contains(&2) && c.contains(&3));
        assert_eq!(c.stats().evictions, 1);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn invalidate_and_retain() {
        let mut c: GraphCache<(u64, u64), u32> = GraphCache::new(8);
        for seq in 0..3 {
            for dtype in 0..2 {
                c.get_or_try_insert_with((seq, dtype), || Ok::<_, ()>((seq * 10 + dtype) as u32)).unwrap();
            }
        }
        assert_eq!(c.invalidate(&(0, 1)), Some(1));
        assert_eq!(c.invalidate(&(0, 1)), None);
        c.retain(|&(seq, _)| seq != 1);
        assert_eq!(c.len(), 3);
        c.clear();
        assert!(c.is_empty());
        assert_eq!(GraphCache::<u8, u8>::new(0).capacity(), 1);
    }
}
