package attach

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
)

// resubscribeWait is how long Watch waits before subscribing again after
// a subscription could not be made; minSubscription is the shortest time
// between two subscriptions, so that one that keeps failing at once does
// not spin.
const (
	resubscribeWait = time.Second
	minSubscription = 100 * time.Millisecond
)

// Watch calls poke on every netlink link, route and neighbour event (FDB
// entries included) of the caller's network namespace, and once after each
// (re)subscription, since events may have been lost while there was none.
// It returns when ctx ends. A subscription that fails (ENOBUFS when events
// come faster than they are read) is replaced.
//
// The events are not interpreted: any of them may add or remove an
// endpoint's interface (a pod's veth appears, its route, its neighbour
// entry, its MAC in the bridge's table), and finding out costs one
// FindEndpoints. poke must not block; bursts of events should be coalesced
// by the caller (a channel of one).
//
// The subscriptions are made from the calling goroutine: call Watch on a
// thread in the namespace to watch.
func (a *Attacher) Watch(ctx context.Context, poke func()) {
	for ctx.Err() == nil {
		start := time.Now()
		var wait time.Duration
		if err := a.watchOnce(ctx, poke); err != nil {
			a.log.Error("subscribe to netlink events; retrying in "+resubscribeWait.String(), "error", err)
			wait = resubscribeWait
		} else {
			wait = minSubscription - time.Since(start)
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
	}
}

// watchOnce subscribes, pokes once, and forwards events until ctx ends or
// a subscription ends on an error.
func (a *Attacher) watchOnce(ctx context.Context, poke func()) error {
	done := make(chan struct{})
	// closing: errors after done is closed are the subscriptions ending as
	// asked, not worth a log line.
	var closing atomic.Bool
	onError := func(what string) func(error) {
		return func(err error) {
			if !closing.Load() {
				a.log.Warn("netlink "+what+" events: resubscribing", "error", err)
			}
		}
	}
	links := make(chan netlink.LinkUpdate, 64)
	routes := make(chan netlink.RouteUpdate, 64)
	neighs := make(chan netlink.NeighUpdate, 64)
	var subscribed []func()
	stop := func() {
		closing.Store(true)
		close(done)
		// The readers close their channel once their socket is closed;
		// until then they may block on a send.
		for _, drain := range subscribed {
			drain()
		}
	}
	err := netlink.LinkSubscribeWithOptions(links, done, netlink.LinkSubscribeOptions{ErrorCallback: onError("link")})
	if err == nil {
		subscribed = append(subscribed, func() {
			for range links {
			}
		})
		err = netlink.RouteSubscribeWithOptions(routes, done, netlink.RouteSubscribeOptions{ErrorCallback: onError("route")})
	}
	if err == nil {
		subscribed = append(subscribed, func() {
			for range routes {
			}
		})
		err = netlink.NeighSubscribeWithOptions(neighs, done, netlink.NeighSubscribeOptions{ErrorCallback: onError("neighbour")})
	}
	if err != nil {
		stop()
		return err
	}
	subscribed = append(subscribed, func() {
		for range neighs {
		}
	})
	defer stop()
	poke()
	for {
		var ok bool
		select {
		case <-ctx.Done():
			return nil
		case _, ok = <-links:
		case _, ok = <-routes:
		case _, ok = <-neighs:
		}
		if !ok {
			return nil // a subscription ended on an error: all again
		}
		poke()
	}
}
