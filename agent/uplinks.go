package agent

import (
	"errors"
	"slices"
	"strings"

	"github.com/rlagent/rlagent/attach"
)

// uplinksProblem is the health key of interfaces: auto finding nothing.
const uplinksProblem = "uplinks"

// findUplinks is attach.Uplinks; tests replace it.
var findUplinks = attach.Uplinks

// refreshUplinks sets a.uplinks, the interfaces the uplink programs run
// on: the config's list, or with interfaces: auto what attach.Uplinks
// finds now. It runs before every reconcile, which a route, address or
// link event wakes, so the uplinks follow the node's default routes: a new
// one is attached before the one it replaces is detached (syncLinks
// attaches, then prunes), and an interface that stays an uplink keeps its
// hook untouched.
//
// A dump that fails keeps the uplinks as they were. Finding nothing
// keeps the last uplinks found, if any, still enforcing (a default route
// is often gone for a moment: DHCP renewing, networkd restarting), with a
// note; with none found ever, the agent is not ready, and says why.
// Callers hold a.mu.
func (a *Agent) refreshUplinks() {
	if !a.cfg.Interfaces.Auto() {
		a.uplinks = slices.Clone([]string(a.cfg.Interfaces))
		a.health.setProblem(uplinksProblem, "")
		a.health.setNote(uplinksProblem, "")
		return
	}
	found, err := findUplinks(a.opts.HostIPs)
	switch {
	case errors.Is(err, attach.ErrNoUplinks) && len(a.uplinks) == 0:
		a.health.setProblem(uplinksProblem, "interfaces auto: "+err.Error()+
			hostIPsHint(a.opts.HostIPs != nil)+"; nothing is enforced at the uplinks")
		a.logOnce("uplinks none", "interfaces auto found no uplink: nothing is enforced at the uplinks until a default route appears",
			"error", err)
		return
	case errors.Is(err, attach.ErrNoUplinks):
		a.health.setNote(uplinksProblem, "interfaces auto: "+err.Error()+"; the last uplinks found ("+
			strings.Join(a.uplinks, ", ")+") stay attached")
		a.logOnce("uplinks gone "+strings.Join(a.uplinks, ","), "interfaces auto found no uplink now: the last ones found stay attached",
			"interfaces", a.uplinks, "error", err)
		return
	case err != nil:
		a.logOnce("uplinks error", "interfaces auto: finding the uplinks failed; the last ones found stay", "error", err)
		return
	}
	a.health.setProblem(uplinksProblem, "")
	a.health.setNote(uplinksProblem, "")
	names := make([]string, len(found))
	for i, u := range found {
		names[i] = u.Name
	}
	if slices.Equal(names, a.uplinks) {
		return
	}
	why := make([]string, len(found))
	for i, u := range found {
		why[i] = u.String()
	}
	a.log.Info("interfaces auto: uplinks found", "interfaces", names, "previous", a.uplinks, "found", why)
	a.uplinks = names
	for k := range a.logged {
		if strings.HasPrefix(k, "uplinks ") {
			delete(a.logged, k) // a later loss or failure is news again
		}
	}
}

func hostIPsHint(set bool) string {
	if set {
		return ""
	}
	return " (HOST_IPS is not set: set it from the pod's status.hostIPs so that the node's own address counts)"
}
