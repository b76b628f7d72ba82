package nettest

import (
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// BulkConfig bounds and paces a BulkSender. Size, Rate, Count and Duration
// are all required.
type BulkConfig struct {
	// Size is the UDP payload of each datagram, in bytes: at least the
	// 20-byte header a Receiver reads, at most 65507. Above the path MTU,
	// the kernel fragments each datagram.
	Size int
	// Rate is the offered rate in datagrams per second.
	Rate float64
	// Count is the most datagrams sent.
	Count int64
	// Duration is the longest the sender runs.
	Duration time.Duration
	// Bin is the width of the bins of Sent (default DefaultBin).
	Bin time.Duration
}

// BulkSender is Sender with datagrams of a chosen size: each carries the
// same header (so that a Receiver counts it by send time), padded.
type BulkSender struct {
	conn *net.UDPConn
	cfg  BulkConfig
	sent *Bins
	errs atomic.Int64
	err  atomic.Pointer[error]

	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
}

// StartBulkSender starts sending on conn, which must be connected. The
// caller still owns conn and closes it after Stop.
func StartBulkSender(conn *net.UDPConn, cfg BulkConfig) (*BulkSender, error) {
	if cfg.Count <= 0 || cfg.Duration <= 0 {
		return nil, fmt.Errorf("bulk sender: Count (%d) and Duration (%s) must both be positive", cfg.Count, cfg.Duration)
	}
	if cfg.Size < payloadLen || cfg.Size > 65507 {
		return nil, fmt.Errorf("bulk sender: Size %d is not in %d..65507", cfg.Size, payloadLen)
	}
	if !(cfg.Rate > 0) || math.IsInf(cfg.Rate, 0) {
		return nil, fmt.Errorf("bulk sender: rate %v is not a positive rate", cfg.Rate)
	}
	s := &BulkSender{
		conn: conn,
		cfg:  cfg,
		sent: newBins(time.Now(), cfg.Bin, cfg.Duration+time.Second),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	go s.run()
	return s, nil
}

// run paces as Sender does: wakes every millisecond, sends what is due,
// never makes up more than 10 ms of lag at once.
func (s *BulkSender) run() {
	defer close(s.done)
	buf := make([]byte, s.cfg.Size)
	start := time.Now()
	deadline := start.Add(s.cfg.Duration)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	var seq uint64
	credit, last := 0.0, start
	for int64(seq) < s.cfg.Count {
		now := time.Now()
		if !now.Before(deadline) {
			return
		}
		credit += s.cfg.Rate * now.Sub(last).Seconds()
		last = now
		credit = min(credit, max(s.cfg.Rate*0.010, 1))
		for ; credit >= 1 && int64(seq) < s.cfg.Count; credit-- {
			at := time.Now()
			putPayload(buf, seq, at)
			seq++
			if _, err := s.conn.Write(buf); err != nil {
				if s.errs.Add(1) == 1 {
					s.err.Store(&err)
				}
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			s.sent.add(at, 1)
		}
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
	}
}

// Stop stops the sender and waits for it. It is idempotent.
func (s *BulkSender) Stop() {
	s.stopOnce.Do(func() { close(s.stop) })
	<-s.done
}

// Done is closed when the sender has stopped, by Stop or by its bounds.
func (s *BulkSender) Done() <-chan struct{} { return s.done }

// Sent counts the datagrams written, by send time.
func (s *BulkSender) Sent() *Bins { return s.sent }

// Errors is the number of failed writes and the first error.
func (s *BulkSender) Errors() (int64, error) {
	n := s.errs.Load()
	if p := s.err.Load(); p != nil {
		return n, *p
	}
	return n, nil
}
