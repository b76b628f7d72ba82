package limiter

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

// table is a keyed limit's buckets: one GCRA pool per key (no shards: a
// million keys cannot each hold a cache per processor), in a bounded
// table.
//
// The table is split in tableShards shards by a seeded hash of the key
// (hash/maphash, a seed per table), so that a client cannot choose keys
// that all land in one shard, and each shard holds at most its part of
// maxKeys. A shard that is full evicts, of a few entries that map
// iteration hands out (Go randomises where it starts), the one whose
// bucket is fullest (smallest tat): an idle key loses nothing by eviction,
// since it would come back full anyway.
//
// An evicted key that still owes (its tat ahead of now: it drew beyond its
// burst's refill) leaves a tombstone: its fingerprint and its tat, in a
// small array of the shard indexed by another part of the hash. A key
// created while its tombstone is there starts with that tat, owing what
// it owed, so that a client cannot get a fresh burst by pushing its own
// key out of the table with others (Envoy's per-descriptor LRU has this
// hole). A tombstone that another eviction overwrites is lost: the key
// then starts full, as a key never seen does.
type table struct {
	seed   maphash.Seed
	shards [tableShards]keyShard
}

const (
	tableShards = 64
	// evictSample is how many entries an eviction looks at.
	evictSample = 8
)

type keyShard struct {
	seed    maphash.Seed // the table's: an eviction hashes its victim again
	mu      sync.RWMutex
	m       map[string]*entry
	max     int
	tombs   []tomb
	evicted uint64 // under mu (write)
	// The limit's counters for the keys of this shard.
	admitted atomic.Uint64
	failed   atomic.Uint64
	waited   atomic.Uint64
}

// entry is one key's bucket: its pool, and a cache of tokens leased from
// it in chunks (as a key-less bucket's shard: a draw within the cache
// reads no clock and swaps nothing), on the same cache line.
type entry struct {
	pool   pool
	tokens atomic.Int64
}

// takeFast draws one token from e's cache.
func (e *entry) takeFast() bool {
	if e.tokens.Add(-1) >= 0 {
		return true
	}
	e.tokens.Add(1)
	return false
}

// tomb remembers an evicted key that owed: until is its tat.
type tomb struct {
	fp    uint32
	until int64
}

func newTable(maxKeys int) *table {
	t := &table{seed: maphash.MakeSeed()}
	per := max((maxKeys+tableShards-1)/tableShards, 1)
	for i := range t.shards {
		s := &t.shards[i]
		s.seed = t.seed
		s.m = make(map[string]*entry)
		s.max = per
		s.tombs = make([]tomb, max(per/4, 4))
	}
	return t
}

// shardOf is key's shard, and its hash.
func (t *table) shardOf(key string) (*keyShard, uint64) {
	h := maphash.String(t.seed, key)
	return &t.shards[h>>58], h
}

// lookup returns key's entry, or nil.
func (s *keyShard) lookup(key string) *entry {
	s.mu.RLock()
	e := s.m[key]
	s.mu.RUnlock()
	return e
}

// get returns key's entry, creating it at now if it is new (evicting one
// if the shard is full).
func (s *keyShard) get(key string, h uint64, now int64) *entry {
	if e := s.lookup(key); e != nil {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.m[key]; e != nil {
		return e // created since
	}
	// The tombstone first: the eviction below may write over it.
	e := &entry{}
	tb := &s.tombs[h%uint64(len(s.tombs))]
	if tb.fp == uint32(h>>26) && tb.until > now {
		e.pool.tat.Store(tb.until) // a returning key owes what it owed
		*tb = tomb{}
	}
	if len(s.m) >= s.max {
		s.evict(now)
	}
	s.m[key] = e
	return e
}

// evict removes the fullest of a sample of entries. Callers hold mu.
func (s *keyShard) evict(now int64) {
	var victim string
	var ve *entry
	n := 0
	for k, e := range s.m {
		if ve == nil || e.pool.tat.Load() < ve.pool.tat.Load() {
			victim, ve = k, e
		}
		if n++; n == evictSample {
			break
		}
	}
	if ve == nil {
		return
	}
	delete(s.m, victim)
	s.evicted++
	if tat := ve.pool.tat.Load(); tat > now {
		// It owes: remember it. (The hash is computed again: an eviction
		// is rare beside a draw.)
		h := maphash.String(s.seed, victim)
		s.tombs[h%uint64(len(s.tombs))] = tomb{fp: uint32(h >> 26), until: tat}
	}
}

// counts sums the shards' counters, keys and evictions.
func (t *table) counts() (admitted, failed, waited, keys, evicted uint64) {
	for i := range t.shards {
		s := &t.shards[i]
		admitted += s.admitted.Load()
		failed += s.failed.Load()
		waited += s.waited.Load()
		s.mu.RLock()
		keys += uint64(len(s.m))
		evicted += s.evicted
		s.mu.RUnlock()
	}
	return
}
