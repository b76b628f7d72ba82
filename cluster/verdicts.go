package cluster

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/rlagent/rlagent/watcher"
)

// A node's reports of what became of its limits (its verdicts) travel in
// its own demand Lease, rlagent-demand-NODE, which the admission policy
// rlagent-demand-leases lets only that node's agent write. The status
// writer reads them from there into the Accepted condition. Events stay
// what people read (kubectl describe), and are no longer read back: an
// Event has no authenticated author, and anyone who may create Events in
// default could have made a node report anything.

// annotationVerdicts holds a node's verdicts: {"limit": nodeVerdict}, the
// limits it cannot apply plainly; a limit it applies is absent.
const annotationVerdicts = "rlagent.io/verdicts"

// Bounds of what a node's verdicts take in its Lease (an object's
// annotations may take 256 KiB in all): each message is cut to
// maxVerdictMessage bytes, and the verdicts, worst first, to
// maxVerdictBytes; a limit left out reads as applied on that node (its
// Events and log still say it).
const (
	maxVerdictMessage = 256
	maxVerdictBytes   = 64 << 10
)

// nodeVerdict is one limit's report in a node's Lease: for which object
// and generation, the reason (a condition reason) and the message.
type nodeVerdict struct {
	UID        types.UID `json:"uid"`
	Generation int64     `json:"generation"`
	Reason     string    `json:"reason"`
	Message    string    `json:"message"`
}

// encodeVerdicts is the annotation's value for vs: the worst verdicts
// first (then by limit name) up to maxVerdictBytes, messages cut to
// maxVerdictMessage.
func encodeVerdicts(vs map[string]nodeVerdict) (string, error) {
	names := slices.SortedFunc(maps.Keys(vs), func(a, b string) int {
		if c := cmp.Compare(severity(vs[b].Reason), severity(vs[a].Reason)); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	out := make(map[string]nodeVerdict, len(vs))
	size := 2
	for _, name := range names {
		v := vs[name]
		if len(v.Message) > maxVerdictMessage {
			v.Message = truncate(v.Message, maxVerdictMessage)
		}
		b, err := json.Marshal(map[string]nodeVerdict{name: v})
		if err != nil {
			return "", err
		}
		if size+len(b) > maxVerdictBytes {
			break
		}
		size += len(b)
		out[name] = v
	}
	b, err := json.Marshal(out)
	return string(b), err
}

// truncate cuts s to at most n bytes, at a rune boundary, marking the cut.
func truncate(s string, n int) string {
	const mark = "..."
	cut := n - len(mark)
	for cut > 0 && cut < len(s) && s[cut]&0xC0 == 0x80 {
		cut--
	}
	return s[:cut] + mark
}

// parseVerdicts reads the verdicts of a node's Lease (nil if it holds
// none, or none that can be read).
func parseVerdicts(l *coordinationv1.Lease) map[string]nodeVerdict {
	raw, ok := l.Annotations[annotationVerdicts]
	if !ok {
		return nil
	}
	var vs map[string]nodeVerdict
	if json.Unmarshal([]byte(raw), &vs) != nil {
		return nil
	}
	return vs
}

// verdictLimits indexes the Leases by the limits their verdicts name.
func verdictLimits(obj any) ([]string, error) {
	l, ok := obj.(*coordinationv1.Lease)
	if !ok {
		return nil, nil
	}
	return slices.Collect(maps.Keys(parseVerdicts(l))), nil
}

// writeVerdicts writes value as the verdicts of node's Lease, keeping the
// rest of it (the demand report, which DemandPublisher writes); a Lease
// that does not exist yet is created with an empty report, renewed now,
// for duration (the publisher's next write sets its own).
func writeVerdicts(ctx context.Context, k *watcher.Kubernetes, value string, now time.Time, duration time.Duration) error {
	ns, name := k.Config().AgentNamespace, DemandLeasePrefix+k.Config().NodeName
	leases := k.Config().Client.CoordinationV1().Leases(ns)
	l, err := leases.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		l = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
				Labels:      map[string]string{labelDemand: "node"},
				Annotations: map[string]string{annotationDemand: "{}", annotationVerdicts: value},
			},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity:       ptr.To(k.Config().NodeName),
				LeaseDurationSeconds: ptr.To(int32(duration / time.Second)),
				RenewTime:            &metav1.MicroTime{Time: now.Truncate(time.Microsecond)},
			},
		}
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create node lease %s/%s: %w", ns, name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("get node lease %s/%s: %w", ns, name, err)
	}
	l = l.DeepCopy()
	if l.Annotations == nil {
		l.Annotations = map[string]string{}
	}
	l.Annotations[annotationVerdicts] = value
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update node lease %s/%s: %w", ns, name, err)
	}
	return nil
}
