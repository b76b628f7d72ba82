package agent

import (
	"fmt"
	"slices"
	"time"

	"github.com/rlagent/rlagent/maps"
)

// Scopes as recorded in the pinned metadata.
var scopeNames = []string{"static", "file", "nodes", "service", "pods"}

func scopeName(s uint8) string {
	if int(s) < len(scopeNames) {
		return scopeNames[s]
	}
	return fmt.Sprintf("scope(%d)", s)
}

// LimitStatus is one limit as `rlagent status` and the metrics show it.
type LimitStatus struct {
	Name        string `json:"name"`
	ID          uint32 `json:"id"`
	Scope       string `json:"scope"`
	Unit        string `json:"unit"`
	Action      string `json:"action"`
	GlobalRate  uint64 `json:"globalRate"`
	GlobalBurst uint64 `json:"globalBurst"`
	// State is what became of the limit on this node: applied (enforced
	// at its share), clamped (enforced, its share clamped to the data
	// path's range) or rejected (it does not fit the data path); Note says
	// why it is not applied. Enforced says whether the data path holds an
	// entry for it: a rejected limit is enforced when the version that did
	// not fit replaced one that did, which stays (Note says so).
	State    string `json:"state"`
	Note     string `json:"note,omitempty"`
	Enforced bool   `json:"enforced"`
	// Replicas is the observed count the global rate is divided by.
	Replicas uint32 `json:"replicas"`
	Local    uint32 `json:"local,omitempty"`
	// ObservationAge is how old the count is, in seconds; -1 if the
	// count source never confirmed it (a static count does not age: 0).
	ObservationAge float64 `json:"observationAgeSeconds"`
	Stale          bool    `json:"stale"`
	ShareRate      uint64  `json:"shareRate"`
	ShareBurst     uint64  `json:"shareBurst"`
	Keys           int     `json:"keys"`
	Evictions      uint64  `json:"evictions"`

	Totals maps.Stats `json:"totals"`
	// Per second over Interval, since the agent's last snapshot.
	AdmittedPerSecond float64 `json:"admittedPerSecond"`
	DroppedPerSecond  float64 `json:"droppedPerSecond"`
	ShadowPerSecond   float64 `json:"shadowPerSecond"`
	Interval          float64 `json:"intervalSeconds"`
}

// readStatus reads every limit of d, its buckets counted afresh. now is the
// wall clock.
func readStatus(d *maps.Reader, now time.Time) ([]LimitStatus, error) {
	keys, err := d.KeyCounts()
	if err != nil {
		return nil, err
	}
	return readStatusKeys(d, now, keys, nil)
}

// readStatusKeys is readStatus with the buckets of each limit counted by
// the caller (keys, by limit id). created, if not nil, holds each limit's
// buckets created (new and returned keys) when they were counted: a
// limit's evictions are what was created then less what was counted then,
// never the buckets created since over an older count.
func readStatusKeys(d *maps.Reader, now time.Time, keys map[uint32]int, created map[uint32]uint64) ([]LimitStatus, error) {
	// The limits set, and those the agent records without an entry.
	ids := d.IDs()
	set := make(map[uint32]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	recorded, err := d.MetaIDs()
	if err != nil {
		return nil, err
	}
	for _, id := range recorded {
		if !set[id] {
			ids = append(ids, id)
		}
	}
	var out []LimitStatus
	for _, id := range ids {
		var l maps.Limit
		if set[id] {
			if l, err = d.Limit(id); err != nil {
				return nil, err
			}
		}
		m, err := d.Meta(id)
		if err != nil {
			return nil, err
		}
		var st maps.Stats
		if set[id] {
			if st, err = d.Stats(id); err != nil {
				return nil, err
			}
		}
		s := LimitStatus{
			Name:        m.Name,
			ID:          id,
			Scope:       scopeName(m.Scope),
			GlobalRate:  m.GlobalRate,
			GlobalBurst: m.GlobalBurst,
			State:       m.State.String(),
			Note:        m.Note,
			Enforced:    set[id],
			Replicas:    m.Replicas,
			Local:       m.Local,
			Stale:       m.Stale,
			ShareRate:   l.Rate,
			ShareBurst:  l.Burst,
			Keys:        keys[id],
			Totals:      st,
		}
		if s.Name == "" {
			s.Name = fmt.Sprintf("limit-%d", id)
		}
		if set[id] {
			// Unit and action are the entry's: a limit without one shows none.
			s.Unit, s.Action = l.Unit.String(), l.Action.String()
		}
		s.ObservationAge = observationAge(m, now)
		if set[id] && l.Key != maps.KeyNone {
			made := st.NewKeys + st.ReturnedKeys
			if created != nil {
				made = created[id] // 0 for a limit set since the count
			}
			s.Evictions = made - min(made, uint64(keys[id]))
		}
		if !m.SnapAt.IsZero() {
			if dt := now.Sub(m.SnapAt).Seconds(); dt > 0 {
				s.Interval = dt
				s.AdmittedPerSecond = float64(st.AdmittedPackets-min(st.AdmittedPackets, m.SnapAdmitted)) / dt
				s.DroppedPerSecond = float64(st.DroppedPackets-min(st.DroppedPackets, m.SnapDropped)) / dt
				s.ShadowPerSecond = float64(st.ShadowPackets-min(st.ShadowPackets, m.SnapShadow)) / dt
			}
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b LimitStatus) int {
		if a.Name < b.Name {
			return -1
		}
		if a.Name > b.Name {
			return 1
		}
		return 0
	})
	return out, nil
}

// observationAge is LimitStatus.ObservationAge.
func observationAge(m maps.Meta, now time.Time) float64 {
	switch {
	case !m.Observed.IsZero():
		return max(now.Sub(m.Observed).Seconds(), 0)
	case m.Scope == scopeStatic:
		return 0
	}
	return -1
}

// ReadStatus reads the status of every limit from the maps pinned in
// pinDir. It loads no program and works while the agent is down.
func ReadStatus(pinDir string) ([]LimitStatus, error) {
	d, err := maps.OpenPinned(pinDir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return readStatus(d, time.Now())
}

// ReadGlobalStats reads the data path's counters that belong to no limit
// (L4-unknown packets, fragments, protected packets, overflow) from the maps
// pinned in pinDir. Like ReadStatus, it writes nothing.
func ReadGlobalStats(pinDir string) (maps.GlobalStats, error) {
	d, err := maps.OpenPinned(pinDir)
	if err != nil {
		return maps.GlobalStats{}, err
	}
	defer d.Close()
	return d.GlobalStats()
}

// keyCountEvery bounds what counting the buckets costs the agent's metrics:
// a count walks the whole bucket table (batch reads of every entry: about
// 0.3 s of a core for 1,000,000 buckets), so the metrics snapshot, which
// is updated every second, counts again only once keyCountEvery times the
// last count's own duration has passed, and at most every second: at most
// 1/keyCountEvery of a core. `rlagent status` counts afresh every time.
const keyCountEvery = 100

// keyCounter is the metrics snapshot's count of the buckets of each limit
// (LimitStatus.Keys), reused between counts as keyCountEvery says.
type keyCounter struct {
	counts  map[uint32]int
	created map[uint32]uint64 // each limit's buckets created, read with counts
	at      time.Time         // when counts was read
	took    time.Duration     // how long that took
}

// get returns the counts and the buckets created then, read again if they
// are due at now.
func (k *keyCounter) get(d *maps.Reader, now time.Time) (map[uint32]int, map[uint32]uint64, error) {
	if k.counts != nil && now.Sub(k.at) < max(time.Second, keyCountEvery*k.took) {
		return k.counts, k.created, nil
	}
	start := time.Now()
	created := make(map[uint32]uint64)
	for _, id := range d.IDs() {
		st, err := d.Stats(id)
		if err != nil {
			return nil, nil, err
		}
		created[id] = st.NewKeys + st.ReturnedKeys
	}
	c, err := d.KeyCounts()
	if err != nil {
		return nil, nil, err
	}
	k.counts, k.created, k.at, k.took = c, created, now, time.Since(start)
	return c, created, nil
}
