package cluster

import (
	"errors"
	"log/slog"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// A failed status write is logged at Warn unless it is a conflict, which
// the retry resolves, and then only its first three retries are quiet.
func TestWriteFailedLevel(t *testing.T) {
	conflict := apierrors.NewConflict(schema.GroupResource{Group: "rlagent.io", Resource: "ratelimits"}, "a", errors.New("modified"))
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "rlagent.io", Resource: "ratelimits"}, "a", errors.New("denied"))
	for _, tt := range []struct {
		name    string
		err     error
		retries int
		want    slog.Level
	}{
		{"conflict", conflict, 0, slog.LevelDebug},
		{"conflict, third retry", conflict, 2, slog.LevelDebug},
		{"conflict, fourth retry", conflict, 3, slog.LevelWarn},
		{"forbidden", forbidden, 0, slog.LevelWarn},
		{"timeout", errors.New("context deadline exceeded"), 0, slog.LevelWarn},
	} {
		if got := writeFailedLevel(tt.err, tt.retries); got != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, got, tt.want)
		}
	}
}
