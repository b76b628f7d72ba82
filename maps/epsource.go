package maps

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/rlagent/rlagent/bpf"
)

// SourceCheck is what an endpoint's egress does with a packet whose source
// is not one of the endpoint's addresses. Either way the packet is counted
// (GlobalStats.EndpointSrcMismatch) and charged to the limits as the
// endpoint's.
type SourceCheck uint32

const (
	// SourceCount counts the packet and lets it pass: NAT, VPN and
	// egress-gateway pods send from other addresses by design.
	SourceCount = SourceCheck(bpf.RatelimitRlEpSrcCheckRL_EP_SRC_COUNT)
	// SourceDrop drops it.
	SourceDrop = SourceCheck(bpf.RatelimitRlEpSrcCheckRL_EP_SRC_DROP)
)

// MaxEndpointSources is the most entries SetEndpointSources writes: one per
// address, and one per interface and family.
const MaxEndpointSources = int(bpf.RatelimitRlConstRL_MAX_EP_SRC)

// SetSourceCheck sets what an endpoint's egress does with a packet from an
// address that is not the endpoint's.
func (d *Datapath) SetSourceCheck(c SourceCheck) error {
	if c != SourceCount && c != SourceDrop {
		return fmt.Errorf("endpoint source check %d: not count (%d) or drop (%d)", c, SourceCount, SourceDrop)
	}
	if d.state.cfg.EpSrcCheck == uint32(c) {
		return nil
	}
	cfg := d.state.cfg
	cfg.EpSrcCheck = uint32(c)
	if err := d.objs.RlCfg.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("endpoint source check: write config: %w", err)
	}
	d.state.cfg = cfg
	return nil
}

// SetEndpointSources makes addrs (an interface's index to the addresses of
// the endpoint behind it) what an endpoint's egress checks a packet's
// source against: a packet on one of these interfaces from another address
// is charged as the interface's lowest address of the packet's family (no
// address of that family: the unspecified one), and counted. A packet on
// an interface not in addrs is not checked. Interfaces and addresses not
// in addrs are removed. IPv4-mapped IPv6 addresses are taken as IPv4.
func (d *Datapath) SetEndpointSources(addrs map[int][]netip.Addr) error {
	return d.writeEndpointSources(addrs, true)
}

// AddEndpointSources writes addrs as SetEndpointSources does but removes
// nothing: for a list that may be incomplete (an interrupted netlink dump),
// where removing what it lacks would count and, with SourceDrop, drop a
// pod's own packets until the next complete list. An interface's charged
// address may change to a lower one it adds.
func (d *Datapath) AddEndpointSources(addrs map[int][]netip.Addr) error {
	return d.writeEndpointSources(addrs, false)
}

func (d *Datapath) writeEndpointSources(addrs map[int][]netip.Addr, prune bool) error {
	want := make(map[bpf.RatelimitRlEpKey]bpf.RatelimitRlEpAddr)
	for idx, as := range addrs {
		if idx <= 0 {
			continue
		}
		as = slices.Clone(as)
		for i := range as {
			as[i] = as[i].Unmap()
		}
		slices.SortFunc(as, func(a, b netip.Addr) int { return a.Compare(b) })
		// The interface is an endpoint's: its packets are checked.
		want[bpf.RatelimitRlEpKey{Ifindex: uint32(idx)}] = bpf.RatelimitRlEpAddr{}
		for _, a := range as {
			if !a.IsValid() || a.IsUnspecified() {
				continue
			}
			lk := localKey(a)
			k := bpf.RatelimitRlEpKey{Ifindex: uint32(idx), Family: lk.Family, A: lk.A}
			want[k] = bpf.RatelimitRlEpAddr{A: lk.A}
			first := bpf.RatelimitRlEpKey{Ifindex: uint32(idx), Family: lk.Family}
			if _, ok := want[first]; !ok {
				want[first] = bpf.RatelimitRlEpAddr{A: lk.A} // the lowest: as sorted
			}
		}
	}
	if len(want) > MaxEndpointSources {
		return fmt.Errorf("endpoint sources: %d entries are more than %d", len(want), MaxEndpointSources)
	}
	if err := syncMap(d.objs.RlEpSrc, want, prune); err != nil {
		return fmt.Errorf("endpoint sources: %w", err)
	}
	return nil
}
