//! The paged KV block pool and the per-request block tables (spec `executor.md` §3.3–§3.4).
//!
//! - Block 0 is the null block: never handed out, and freeing it is a no-op (padding and unused
//!   table entries point at it, as in the seed system).
//! - Allocation is all-or-nothing: a request either gets every block it asks for in one call or
//!   none, so a failed allocation never leaves a half-grown table behind.
//! - Freed blocks go to the back of a FIFO queue, so a block just freed is the last to be reused
//!   (easier to spot a stale read in a test than LIFO reuse).
//!
//! The DeepSeek-V3 family has one cache type (the latent cache, every layer sharing one block
//! table), so one pool serves all of a model's layers; a family with several cache types (V4)
//! will hold one [`BlockPool`] per type behind the same all-or-nothing [`KvBlockManager`] call.
//!
//! Prefix caching ([`KvBlockManager::enable_prefix_caching`]: vLLM's automatic prefix caching;
//! the seed system has none, spec `executor.md` §3.4 and `deepseek-v3-r1-kimi-k2.md` §3.4):
//! - a block whose `block_size` tokens all have their KV computed is registered under a key
//!   that hashes its tokens and its parent block's key ([`block_key`]), so a key names the
//!   whole prefix up to the block's end; the block also keeps its tokens and parent key, and a
//!   lookup compares them, so a hit is exact;
//! - a new request whose first full blocks are registered shares those blocks instead of
//!   computing them: blocks are reference-counted, and a shared block is never written (only
//!   full blocks are registered, and a request writes only past its computed tokens);
//! - a block whose last holder lets go stays registered while it waits in the free queue; any
//!   allocation may take it (least recently freed first), which unregisters it. A table is
//!   freed tail first, so a prefix outlives its continuations;
//! - with a lookahead of k tokens ([`KvBlockManager::set_prefix_lookahead`]; MTP: the MTP
//!   layer's cache row at position i pairs the hidden state at i with token i + 1), a block's
//!   key and compared tokens also take the k tokens after it, so a block is shared only where
//!   its cache rows, the MTP layer's included, are what the sharer would write.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// The null block's id.
pub const NULL_BLOCK: u32 = 0;

/// A full block's prefix-cache key: a 128-bit hash of its parent block's key and its tokens.
pub type BlockKey = u128;

/// The key of a full block of `tokens` after the block keyed `parent` (None: the first block).
/// Two SipHash passes (std's fixed-key hasher, the same in every process of one build, so
/// ranks stepping the same batches agree) with different domain tags.
pub fn block_key(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    let half = |tag: u8| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        tag.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("block {0} is freed twice or was never handed out")]
    DoubleFree(u32),
    #[error("block {0} is outside the pool of {1} blocks")]
    OutOfRange(u32, usize),
}

/// Fixed-size blocks `1..num_blocks`, reference-counted: handed out, shared, taken back.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: usize,
    /// Free blocks in the order they were freed, as (block, generation); an entry whose
    /// generation is not the block's current one is stale (the block was taken back out of
    /// the queue by [`BlockPool::share`]) and skipped.
    free: VecDeque<(u32, u32)>,
    generation: Vec<u32>,
    /// Holders of each block (0: free; the null block is never counted).
    refs: Vec<u32>,
    num_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, the first of which is the reserved null block (so
    /// `num_blocks - 1` are usable). `num_blocks` must be at least 2.
    pub fn new(num_blocks: usize) -> BlockPool {
        assert!(num_blocks >= 2, "a pool needs the null block and one more");
        let mut refs = vec![0; num_blocks];
        refs[0] = 1;
        BlockPool {
            num_blocks,
            free: (1..num_blocks as u32).map(|b| (b, 0)).collect(),
            generation: vec![0; num_blocks],
            refs,
            num_free: num_blocks - 1,
        }
    }

    /// All blocks, the null block included (the size of the cache tensor).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Blocks that can ever be handed out.
    pub fn capacity(&self) -> usize {
        self.num_blocks - 1
    }
    /// Blocks no request holds (cached ones among them).
    pub fn num_free(&self) -> usize {
        self.num_free
    }
    /// Blocks some request holds.
    pub fn num_used(&self) -> usize {
        self.capacity() - self.num_free
    }
    /// How many requests hold `block`.
    pub fn holders(&self, block: u32) -> u32 {
        if block == NULL_BLOCK {
            return 0;
        }
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// `n` blocks, or `None` (and nothing taken) when fewer than `n` are free. The least
    /// recently freed come first.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let (b, g) = self
                .free
                .pop_front()
                .expect("num_free counts the queue's live entries");
            if self.refs[b as usize] == 0 && self.generation[b as usize] == g {
                self.refs[b as usize] = 1;
                out.push(b);
            }
        }
        self.num_free -= n;
        Some(out)
    }

    /// One more holder of `block`, which is held already or free (a free one leaves the queue).
    fn share(&mut self, block: u32) {
        let b = block as usize;
        if self.refs[b] == 0 {
            self.generation[b] = self.generation[b].wrapping_add(1);
            self.num_free -= 1;
        }
        self.refs[b] += 1;
    }

    /// Lets go of blocks (one holder each); a block nobody holds any more goes to the back of
    /// the free queue. The null block is ignored; a block listed twice, or freed while free, is
    /// an error (and nothing is freed).
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), PoolError> {
        let mut seen = std::collections::HashSet::new();
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            if b as usize >= self.num_blocks {
                return Err(PoolError::OutOfRange(b, self.num_blocks));
            }
            if self.refs[b as usize] == 0 || !seen.insert(b) {
                return Err(PoolError::DoubleFree(b));
            }
        }
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            let i = b as usize;
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                self.generation[i] = self.generation[i].wrapping_add(1);
                self.free.push_back((b, self.generation[i]));
                self.num_free += 1;
            }
        }
        // Stale entries (blocks shared again out of the queue) are dropped once they outnumber
        // the live ones, so the queue stays within twice the pool.
        if self.free.len() > 2 * self.num_free + 64 {
            let (refs, generation) = (&self.refs, &self.generation);
            self.free
                .retain(|&(b, g)| refs[b as usize] == 0 && generation[b as usize] == g);
        }
        Ok(())
    }

    pub fn is_free(&self, block: u32) -> bool {
        block != NULL_BLOCK && self.refs.get(block as usize) == Some(&0)
    }

    /// The free queue's live entries, in order. For tests.
    fn free_order(&self) -> Vec<u32> {
        self.free
            .iter()
            .filter(|&&(b, g)| self.refs[b as usize] == 0 && self.generation[b as usize] == g)
            .map(|&(b, _)| b)
            .collect()
    }
}

/// How many blocks fit in a byte budget, given the bytes one block takes across all layers.
/// The result counts the null block, and is at least 2 (one usable block).
pub fn blocks_for_budget(budget_bytes: u64, bytes_per_block: u64) -> usize {
    ((budget_bytes / bytes_per_block.max(1)) as usize).max(2)
}

/// What a registered block holds: its key, its parent's key and its tokens (compared on a
/// lookup, so a hit never rests on the hash alone).
#[derive(Debug, Clone)]
struct Registered {
    key: BlockKey,
    parent: Option<BlockKey>,
    tokens: Vec<u32>,
}

/// The prefix cache's index over the pool's blocks.
#[derive(Debug, Clone, Default)]
struct PrefixIndex {
    /// Cleared since it was made (blocks shared before may now be held unregistered).
    cleared: bool,
    by_key: HashMap<BlockKey, u32>,
    /// Per block.
    entry: Vec<Option<Registered>>,
}

/// Block tables of the requests holding cache, over one [`BlockPool`].
#[derive(Debug, Clone)]
pub struct KvBlockManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<u64, Vec<u32>>,
    peak_used: usize,
    prefix: Option<PrefixIndex>,
    /// Tokens after a block that its cache rows depend on (and its key takes).
    lookahead: usize,
}

impl KvBlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> KvBlockManager {
        assert!(block_size > 0, "block_size must be positive");
        KvBlockManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
            peak_used: 0,
            prefix: None,
            lookahead: 0,
        }
    }

    /// How many tokens after a block its cache rows depend on (0: none; 1 with MTP): keys and
    /// the compared tokens of a block span `block_size + n` tokens. A change forgets the blocks
    /// registered before it.
    pub fn set_prefix_lookahead(&mut self, n: usize) {
        if n != self.lookahead && self.num_cached_blocks() > 0 {
            self.clear_prefix_cache();
        }
        self.lookahead = n;
    }
    pub fn prefix_lookahead(&self) -> usize {
        self.lookahead
    }

    /// Turns on prefix caching (module docs). Blocks computed from now on can be registered
    /// and shared.
    pub fn enable_prefix_caching(&mut self) {
        if self.prefix.is_none() {
            self.prefix = Some(PrefixIndex {
                cleared: false,
                by_key: HashMap::new(),
                entry: vec![None; self.pool.num_blocks()],
            });
        }
    }
    pub fn prefix_caching(&self) -> bool {
        self.prefix.is_some()
    }
    /// Blocks registered in the prefix cache (held or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.by_key.len())
    }
    /// Forgets every registered block (their KV may no longer be what the keys say: after a
    /// forward that failed part way).
    pub fn clear_prefix_cache(&mut self) {
        if let Some(p) = &mut self.prefix {
            p.cleared = true;
            p.by_key.clear();
            p.entry.iter_mut().for_each(|e| *e = None);
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.capacity() * self.block_size
    }
    /// The most blocks held at once since the start.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// Blocks a request must hold to cover `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// More blocks `req` needs to cover `tokens` positions.
    pub fn blocks_needed(&self, req: u64, tokens: usize) -> usize {
        let held = self.tables.get(&req).map_or(0, Vec::len);
        self.blocks_for(tokens).saturating_sub(held)
    }

    /// `n` blocks from the pool, unregistering any cached ones taken.
    fn take_blocks(&mut self, n: usize) -> Option<Vec<u32>> {
        let blocks = self.pool.allocate(n)?;
        if let Some(p) = &mut self.prefix {
            for &b in &blocks {
                if let Some(e) = p.entry[b as usize].take() {
                    p.by_key.remove(&e.key);
                }
            }
        }
        Some(blocks)
    }

    /// Grows `req`'s table to cover `tokens` positions; false (and nothing allocated) when the
    /// pool has too few free blocks.
    pub fn allocate_slots(&mut self, req: u64, tokens: usize) -> bool {
        let need = self.blocks_needed(req, tokens);
        if need == 0 {
            return true;
        }
        match self.take_blocks(need) {
            Some(blocks) => {
                self.tables.entry(req).or_default().extend(blocks);
                self.peak_used = self.peak_used.max(self.pool.num_used());
                true
            }
            None => false,
        }
    }

    /// The registered blocks of the longest cached prefix of full blocks: `keys[i]` is the key
    /// of tokens `i·block_size..(i + 1)·block_size + lookahead` of `tokens`. Nothing is taken.
    pub fn cached_prefix(&self, keys: &[BlockKey], tokens: &[u32]) -> Vec<u32> {
        let Some(p) = &self.prefix else {
            return Vec::new();
        };
        let bs = self.block_size;
        let mut out = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(&b) = p.by_key.get(key) else { break };
            let parent = i.checked_sub(1).map(|j| keys[j]);
            let exact = p.entry[b as usize].as_ref().is_some_and(|e| {
                e.key == *key
                    && e.parent == parent
                    && tokens.get(i * bs..(i + 1) * bs + self.lookahead)
                        == Some(e.tokens.as_slice())
            });
            if !exact {
                break;
            }
            out.push(b);
        }
        out
    }

    /// Whether a request holding no blocks could take the cached blocks `prefix` and fresh
    /// ones after them up to `tokens` positions now (what [`KvBlockManager::allocate_with_prefix`]
    /// would do); nothing is taken.
    pub fn fits_with_prefix(&self, prefix: &[u32], tokens: usize) -> bool {
        let fresh = self.blocks_for(tokens).saturating_sub(prefix.len());
        let revived = prefix.iter().filter(|&&b| self.pool.is_free(b)).count();
        self.pool.num_free() >= revived + fresh
    }

    /// Gives `req` (which holds no blocks) the cached blocks `prefix` (from
    /// [`KvBlockManager::cached_prefix`]) and fresh blocks after them up to `tokens` positions,
    /// all or nothing: false (nothing changed) when the pool lacks the fresh ones.
    pub fn allocate_with_prefix(&mut self, req: u64, prefix: &[u32], tokens: usize) -> bool {
        debug_assert!(self.block_table(req).is_empty());
        if !self.fits_with_prefix(prefix, tokens) {
            return false;
        }
        let fresh = self.blocks_for(tokens).saturating_sub(prefix.len());
        for &b in prefix {
            self.pool.share(b);
        }
        let new = self.take_blocks(fresh).expect("counted free blocks");
        let table = self.tables.entry(req).or_default();
        table.extend_from_slice(prefix);
        table.extend(new);
        self.peak_used = self.peak_used.max(self.pool.num_used());
        true
    }

    /// Registers block `index` of `req`'s table, whose tokens (all computed; then the lookahead's)
    /// are `tokens`, under
    /// `key` (after the block keyed `parent`). Nothing happens when prefix caching is off, the
    /// key is registered already (another request computed the same prefix: this block stays
    /// private) or the block is.
    pub fn register(
        &mut self,
        req: u64,
        index: usize,
        key: BlockKey,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) {
        let Some(&b) = self.tables.get(&req).and_then(|t| t.get(index)) else {
            return;
        };
        let Some(p) = &mut self.prefix else { return };
        if b == NULL_BLOCK || p.by_key.contains_key(&key) || p.entry[b as usize].is_some() {
            return;
        }
        debug_assert_eq!(tokens.len(), self.block_size + self.lookahead);
        p.by_key.insert(key, b);
        p.entry[b as usize] = Some(Registered {
            key,
            parent,
            tokens: tokens.to_vec(),
        });
    }

    pub fn block_table(&self, req: u64) -> &[u32] {
        self.tables.get(&req).map_or(&[], Vec::as_slice)
    }

    /// Shrinks `req`'s table to the blocks that cover `tokens` positions, returning the rest to
    /// the pool (speculative decoding: blocks held only for rejected drafts). Returns how many
    /// blocks were released.
    pub fn trim(&mut self, req: u64, tokens: usize) -> usize {
        let keep = self.blocks_for(tokens);
        let Some(table) = self.tables.get_mut(&req) else {
            return 0;
        };
        if table.len() <= keep {
            return 0;
        }
        let mut tail = table.split_off(keep);
        if table.is_empty() {
            self.tables.remove(&req);
        }
        tail.reverse();
        self.pool
            .free(&tail)
            .expect("a request's table holds each of its blocks once");
        tail.len()
    }

    /// Lets go of every block `req` holds (nothing if it holds none), its last block first.
    pub fn free(&mut self, req: u64) {
        if let Some(mut t) = self.tables.remove(&req) {
            t.reverse();
            self.pool
                .free(&t)
                .expect("a request's table holds each of its blocks once");
        }
    }

    /// Requests holding blocks.
    pub fn holders(&self) -> impl Iterator<Item = (&u64, &Vec<u32>)> {
        self.tables.iter()
    }

    /// Checks that every block is free or held, each held block by as many tables as its
    /// count says (and only a registered block by more than one), no table holds a block twice
    /// or the null block, and the prefix index and its blocks agree. For tests and debug
    /// assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut count = vec![0u32; self.pool.num_blocks()];
        for (&req, table) in &self.tables {
            let mut seen = std::collections::HashSet::new();
            for &b in table {
                if b == NULL_BLOCK {
                    return Err(format!("request {req} holds the null block"));
                }
                if self.pool.is_free(b) {
                    return Err(format!("request {req} holds free block {b}"));
                }
                if !seen.insert(b) {
                    return Err(format!("request {req} holds block {b} twice"));
                }
                count[b as usize] += 1;
            }
        }
        for (b, &c) in count.iter().enumerate().skip(1) {
            let refs = self.pool.holders(b as u32);
            if refs != c {
                return Err(format!(
                    "block {b} counts {refs} holders, {c} tables hold it"
                ));
            }
            let registered = self
                .prefix
                .as_ref()
                .is_some_and(|p| p.cleared || p.entry[b].is_some());
            if c > 1 && !registered {
                return Err(format!("unregistered block {b} is held by {c} requests"));
            }
        }
        let held = count.iter().filter(|&&c| c > 0).count();
        if held + self.pool.num_free() != self.pool.capacity() {
            return Err(format!(
                "{held} held + {} free != {} usable: blocks leaked",
                self.pool.num_free(),
                self.pool.capacity()
            ));
        }
        if self.pool.free_order().len() != self.pool.num_free() {
            return Err("the free queue and the free count disagree".into());
        }
        if let Some(p) = &self.prefix {
            for (&key, &b) in &p.by_key {
                if p.entry[b as usize].as_ref().map(|e| e.key) != Some(key) {
                    return Err(format!("key {key:x} names block {b}, registered otherwise"));
                }
            }
            let registered = p.entry.iter().filter(|e| e.is_some()).count();
            if registered != p.by_key.len() {
                return Err(format!(
                    "{registered} blocks registered, {} keys",
                    p.by_key.len()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_block_is_never_handed_out() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.capacity(), 3);
        let b = p.allocate(3).unwrap();
        assert!(!b.contains(&NULL_BLOCK));
        assert_eq!(p.allocate(1), None);
        p.free(&[NULL_BLOCK]).unwrap();
        assert_eq!(p.num_free(), 0);
    }

    #[test]
    fn allocation_is_all_or_nothing_and_double_free_is_refused() {
        let mut p = BlockPool::new(5);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.allocate(2), None);
        assert_eq!(p.num_free(), 1);
        p.free(&a).unwrap();
        assert_eq!(p.free(&a[..1]), Err(PoolError::DoubleFree(a[0])));
        assert_eq!(p.free(&[9]), Err(PoolError::OutOfRange(9, 5)));
        assert_eq!(p.num_free(), 4);
    }

    #[test]
    fn freed_blocks_are_reused_last() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(1).unwrap();
        p.free(&a).unwrap();
        assert_eq!(p.allocate(3).unwrap(), vec![2, 3, 1]);
    }

    #[test]
    fn manager_grows_tables_by_blocks() {
        let mut m = KvBlockManager::new(5, 4);
        assert!(m.allocate_slots(7, 5));
        assert_eq!(m.block_table(7).len(), 2);
        assert!(m.allocate_slots(7, 8));
        assert_eq!(m.block_table(7).len(), 2);
        assert!(!m.allocate_slots(8, 9), "3 blocks wanted, 2 free");
        assert!(m.block_table(8).is_empty());
        assert!(m.allocate_slots(8, 8));
        assert_eq!(m.peak_used(), 4);
        m.free(7);
        m.check_invariants().unwrap();
        assert_eq!(m.pool().num_free(), 2);
    }

    #[test]
    fn trim_returns_the_tail_blocks() {
        let mut m = KvBlockManager::new(6, 4);
        assert!(m.allocate_slots(1, 13));
        assert_eq!(m.block_table(1).len(), 4);
        assert_eq!(m.trim(1, 9), 1);
        assert_eq!(m.block_table(1).len(), 3);
        assert_eq!(m.trim(1, 12), 0);
        assert_eq!(m.trim(1, 0), 3);
        assert!(m.holders().next().is_none());
        assert_eq!(m.trim(9, 0), 0);
        m.check_invariants().unwrap();
        assert_eq!(m.pool().num_free(), 5);
    }

    #[test]
    fn budget_sizes_the_pool() {
        assert_eq!(blocks_for_budget(1000, 100), 10);
        assert_eq!(blocks_for_budget(10, 100), 2);
    }

    /// Keys of each full block of `tokens`, chained.
    fn keys(tokens: &[u32], bs: usize) -> Vec<BlockKey> {
        let mut out: Vec<BlockKey> = Vec::new();
        for c in tokens.chunks_exact(bs) {
            out.push(block_key(out.last().copied(), c));
        }
        out
    }

    #[test]
    fn keys_name_the_whole_prefix() {
        let a = keys(&[1, 2, 3, 4], 2);
        let b = keys(&[9, 9, 3, 4], 2);
        assert_ne!(a[1], b[1], "same block after another prefix");
        assert_eq!(a, keys(&[1, 2, 3, 4, 5], 2));
        assert_ne!(block_key(None, &[1, 2]), block_key(None, &[2, 1]));
    }

    #[test]
    fn registered_blocks_are_shared_then_cached_then_evicted() {
        // 6 usable blocks of 2 tokens.
        let mut m = KvBlockManager::new(7, 2);
        m.enable_prefix_caching();
        let t = [5, 6, 7, 8, 9];
        let k = keys(&t, 2);
        assert!(m.allocate_slots(1, 5));
        let first = m.block_table(1).to_vec();
        m.register(1, 0, k[0], None, &t[0..2]);
        m.register(1, 1, k[1], Some(k[0]), &t[2..4]);
        assert_eq!(m.num_cached_blocks(), 2);
        // A second request with the same first two blocks shares them.
        let hit = m.cached_prefix(&k, &t);
        assert_eq!(hit, first[..2]);
        assert!(m.allocate_with_prefix(2, &hit, 5));
        assert_eq!(m.block_table(2)[..2], first[..2]);
        assert_ne!(m.block_table(2)[2], first[2]);
        assert_eq!(m.pool().holders(first[0]), 2);
        m.check_invariants().unwrap();
        // Other tokens under the same hash position do not hit.
        let other = [5, 6, 7, 0, 9];
        assert_eq!(m.cached_prefix(&keys(&other, 2), &other), first[..1]);
        // Both let go: the blocks stay cached while free.
        m.free(1);
        m.free(2);
        assert_eq!(m.pool().num_used(), 0);
        assert_eq!(m.num_cached_blocks(), 2);
        m.check_invariants().unwrap();
        // A later request revives them out of the free queue.
        assert!(m.allocate_with_prefix(3, &m.cached_prefix(&k, &t), 5));
        assert_eq!(m.block_table(3)[..2], first[..2]);
        assert_eq!(m.pool().num_free(), 3);
        m.check_invariants().unwrap();
        m.free(3);
        // Allocating the whole pool takes the cached blocks too and unregisters them.
        assert!(m.allocate_slots(4, 12));
        assert_eq!(m.num_cached_blocks(), 0);
        assert!(m.cached_prefix(&k, &t).is_empty());
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_allocation_is_all_or_nothing() {
        let mut m = KvBlockManager::new(5, 2);
        m.enable_prefix_caching();
        let t = [1, 2, 3, 4];
        let k = keys(&t, 2);
        assert!(m.allocate_slots(1, 4));
        m.register(1, 0, k[0], None, &t[..2]);
        m.free(1);
        // Cached block 1 free, 3 other free blocks: the hit plus 3 fresh fit, plus 4 do not.
        let hit = m.cached_prefix(&k, &t);
        assert_eq!(hit.len(), 1);
        assert!(!m.allocate_with_prefix(2, &hit, 10));
        assert!(m.block_table(2).is_empty());
        assert_eq!(m.pool().num_free(), 4);
        assert!(m.allocate_with_prefix(2, &hit, 8));
        assert_eq!(m.pool().num_free(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn the_first_registration_of_a_prefix_wins() {
        let mut m = KvBlockManager::new(5, 2);
        m.enable_prefix_caching();
        let k = block_key(None, &[1, 2]);
        assert!(m.allocate_slots(1, 2));
        assert!(m.allocate_slots(2, 2));
        m.register(1, 0, k, None, &[1, 2]);
        m.register(2, 0, k, None, &[1, 2]);
        assert_eq!(m.cached_prefix(&[k], &[1, 2]), m.block_table(1));
        // Off: nothing is registered.
        let mut off = KvBlockManager::new(5, 2);
        assert!(off.allocate_slots(1, 2));
        off.register(1, 0, k, None, &[1, 2]);
        assert!(off.cached_prefix(&[k], &[1, 2]).is_empty());
    }
}
