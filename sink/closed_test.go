package sink_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/fault"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
)

// TestClosedConnectionIsPermanent: a subject over the server's
// max_control_line makes the server answer -ERR 'Maximum Control Line
// Exceeded' and nats.go close the connection for good (CLOSED, whatever
// MaxReconnects). Every publish in flight then fails at once, long before
// the publish timeout, with a permanent error saying so, and so does every
// later session: jetbox stops instead of retrying for ever.
func TestClosedConnectionIsPermanent(t *testing.T) {
	n := testenv.StartNATS(t)
	cfg := baseConfig()
	cfg.PublishTimeout = 5 * time.Minute // the failures must not wait for it
	p := streamPublisher(t, n, cfg)
	if got := p.SubjectLimit(); got != sink.DefaultMaxControlLine-87 {
		t.Fatalf("SubjectLimit %d at the default max_control_line", got)
	}
	if p.ClosedError() != nil {
		t.Fatal("ClosedError on an open connection")
	}
	sess, err := p.Open(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	long := event("long", "order", strings.Repeat("E", 5000)) // as if the decoder had no limit
	dones := make(chan error, 2)
	if err := sess.Publish(event("first", "order", "E"), func(err error) { dones <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-dones; err != nil {
		t.Fatalf("first publish: %v", err)
	}
	if err := sess.Publish(long, func(err error) { dones <- err }); err != nil && !fault.Is(err) {
		t.Fatalf("long subject: a transient error %v", err)
	} else if err == nil {
		select {
		case err := <-dones:
			if !fault.Is(err) || !strings.Contains(err.Error(), "closed for good") {
				t.Fatalf("long subject: done(%v), want the permanent closed error", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the publish in flight on a closed connection did not fail within 30s")
		}
	}
	select {
	case <-p.Closed():
	case <-time.After(10 * time.Second):
		t.Fatal("Closed not closed")
	}
	err = p.ClosedError()
	var pe *sink.PermanentError
	if !errors.As(err, &pe) || !strings.Contains(err.Error(), "maximum control line exceeded") || !strings.Contains(pe.Hint, "--nats-max-control-line") {
		t.Fatalf("ClosedError: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = sess.Close(ctx)
	if _, err := p.Open(ctx, "test"); !fault.Is(err) || !strings.Contains(err.Error(), "closed for good") {
		t.Fatalf("a new session on the closed connection: %v", err)
	}
}
