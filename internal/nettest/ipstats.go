package nettest

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// IPStats are a namespace's IP counters, IPv4 and IPv6 added up. They count
// what the IP layer received, after any XDP program: every fragment on its
// own (InReceives, InOctets), and the reassemblies.
type IPStats struct {
	InReceives uint64 // IP packets received (fragments one by one)
	InOctets   uint64 // their bytes, IP header included (no Ethernet header)
	ReasmReqds uint64 // fragments that needed reassembly
	ReasmOKs   uint64 // datagrams reassembled
	ReasmFails uint64 // reassembly failures (timeouts, overlaps, no memory, ...)
	// FragQueues and FragMemory are the datagrams being reassembled now
	// and the bytes they hold (/proc/net/sockstat's FRAG lines): the
	// kernel refuses new fragments above net.ipv4.ipfrag_high_thresh
	// (net.ipv6.ip6frag_high_thresh).
	FragQueues, FragMemory uint64
}

// IPStats reads the namespace's IP counters from /proc/net/snmp,
// /proc/net/netstat and /proc/net/snmp6.
func (ns *NS) IPStats() (IPStats, error) {
	var s IPStats
	err := ns.Do(func() error {
		// /proc/thread-self/net is this thread's namespace's view.
		v4 := map[string]*uint64{
			"Ip:InReceives": &s.InReceives, "Ip:ReasmReqds": &s.ReasmReqds,
			"Ip:ReasmOKs": &s.ReasmOKs, "Ip:ReasmFails": &s.ReasmFails,
			"IpExt:InOctets": &s.InOctets,
		}
		for _, f := range []string{"/proc/thread-self/net/snmp", "/proc/thread-self/net/netstat"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			addTables(string(b), v4)
		}
		for _, f := range []string{"/proc/thread-self/net/sockstat", "/proc/thread-self/net/sockstat6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				continue // IPv6 disabled
			}
			for line := range strings.SplitSeq(string(b), "\n") {
				// FRAG: inuse 0 memory 0
				f := strings.Fields(line)
				if len(f) == 5 && (f[0] == "FRAG:" || f[0] == "FRAG6:") {
					q, _ := strconv.ParseUint(f[2], 10, 64)
					m, _ := strconv.ParseUint(f[4], 10, 64)
					s.FragQueues += q
					s.FragMemory += m
				}
			}
		}
		b, err := os.ReadFile("/proc/thread-self/net/snmp6")
		if err != nil {
			return nil // IPv6 disabled
		}
		v6 := map[string]*uint64{
			"Ip6InReceives": &s.InReceives, "Ip6InOctets": &s.InOctets, "Ip6ReasmReqds": &s.ReasmReqds,
			"Ip6ReasmOKs": &s.ReasmOKs, "Ip6ReasmFails": &s.ReasmFails,
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) != 2 {
				continue
			}
			if p, ok := v6[f[0]]; ok {
				v, _ := strconv.ParseUint(f[1], 10, 64)
				*p += v
			}
		}
		return nil
	})
	if err != nil {
		return IPStats{}, fmt.Errorf("ip stats of %s: %w", ns.Name, err)
	}
	return s, nil
}

// addTables adds the counters named "Table:Field" in want from a file of
// /proc/net/snmp's shape: a line of field names, then a line of values, per
// table.
func addTables(text string, want map[string]*uint64) {
	var head []string
	for line := range strings.SplitSeq(text, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if head == nil || head[0] != f[0] {
			head = f
			continue
		}
		for i := 1; i < len(f) && i < len(head); i++ {
			if p, ok := want[f[0]+head[i]]; ok {
				v, _ := strconv.ParseUint(f[i], 10, 64)
				*p += v
			}
		}
		head = nil
	}
}

// Sub is s - o, field by field, for the counters; the gauges (FragQueues,
// FragMemory) are s's.
func (s IPStats) Sub(o IPStats) IPStats {
	return IPStats{
		FragQueues: s.FragQueues,
		FragMemory: s.FragMemory,
		InReceives: s.InReceives - o.InReceives,
		InOctets:   s.InOctets - o.InOctets,
		ReasmReqds: s.ReasmReqds - o.ReasmReqds,
		ReasmOKs:   s.ReasmOKs - o.ReasmOKs,
		ReasmFails: s.ReasmFails - o.ReasmFails,
	}
}
