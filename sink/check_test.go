package sink_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go/jetstream"
)

// TestCheckExactlyOnceStream: in exactly-once mode, Check refuses a stream
// whose last message can disappear or come from another writer (work queue
// and interest retention, sources, a foreign last message, a max age below
// the planned outage), naming --delivery=dedup; a longer max age and extra
// subjects are warnings; message and byte limits, and a stream jetbox
// creates, pass. Dedup mode refuses none of them.
func TestCheckExactlyOnceStream(t *testing.T) {
	n := testenv.StartNATS(t)
	_, js := n.Connect(t)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORIGIN", Subjects: []string{"origin.>"}}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		cfg      jetstream.StreamConfig
		foreign  bool   // publish a message that is not jetbox's
		severity string // of the nats.exactly_once finding that names the problem; "" = none
		what     string
	}{
		{"limits", jetstream.StreamConfig{}, false, "", ""},
		{"message and byte limits", jetstream.StreamConfig{MaxMsgs: 10, MaxBytes: 1 << 20, MaxMsgsPerSubject: 1}, false, "", ""},
		{"work queue", jetstream.StreamConfig{Retention: jetstream.WorkQueuePolicy}, false, "error", "WorkQueue retention"},
		{"interest", jetstream.StreamConfig{Retention: jetstream.InterestPolicy}, false, "error", "Interest retention"},
		{"sources", jetstream.StreamConfig{Sources: []*jetstream.StreamSource{{Name: "ORIGIN"}}}, false, "error", "sources messages from"},
		{"foreign last message", jetstream.StreamConfig{}, true, "error", "was not written by jetbox"},
		{"short max age", jetstream.StreamConfig{MaxAge: time.Minute}, false, "error", "--max-outage 10m0s is longer"},
		{"long max age", jetstream.StreamConfig{MaxAge: 24 * time.Hour}, false, "warning", "max age 24h0m0s"},
		{"extra subjects", jetstream.StreamConfig{Subjects: []string{"outbox.>", "other.>"}}, false, "warning", `also captures ["other.>"]`},
	}
	// Each case has a stream of its own name: a stream created right after
	// one of the same name was deleted can come back with the deleted one's
	// messages (seen with the embedded nats-server: the foreign case's
	// message in the next case's new stream).
	prev := ""
	for _, c := range cases {
		name := "OUTBOX_" + strings.ReplaceAll(c.name, " ", "_")
		t.Run(c.name, func(t *testing.T) {
			if prev != "" {
				if err := js.DeleteStream(ctx, prev); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
					t.Fatalf("delete the previous case's stream: %v", err)
				}
			}
			prev = name
			sc := c.cfg
			sc.Name = name
			if sc.Subjects == nil {
				sc.Subjects = []string{"outbox.>"}
			}
			if _, err := js.CreateStream(ctx, sc); err != nil {
				t.Fatal(err)
			}
			if c.foreign {
				if _, err := js.Publish(ctx, "outbox.intruder.Hello", []byte("not from jetbox")); err != nil {
					t.Fatal(err)
				}
			}
			cfg := baseConfig()
			cfg.Stream, cfg.Delivery = name, sink.ExactlyOnce
			found := check.Named(newPublisher(t, n, cfg).Check(ctx, 10*time.Minute), "nats.exactly_once")
			var hit *check.Finding
			for i, f := range found {
				if f.Severity != check.Info {
					if hit != nil {
						t.Fatalf("more than one problem: %+v", found)
					}
					hit = &found[i]
				}
			}
			switch {
			case c.severity == "" && hit != nil:
				t.Fatalf("unexpected finding %+v", *hit)
			case c.severity == "":
			case hit == nil:
				t.Fatalf("no %s finding, got %+v", c.severity, found)
			case string(hit.Severity) != c.severity || !strings.Contains(hit.What, c.what) || !strings.Contains(hit.Hint, "--delivery=dedup"):
				t.Fatalf("got %+v, want %s %q with a --delivery=dedup fix", *hit, c.severity, c.what)
			}
			cfg.Delivery = sink.DedupGuarded
			if fs := newPublisher(t, n, cfg).Check(ctx, 10*time.Minute); check.Fatal(fs) {
				t.Fatalf("dedup mode refuses the stream: %+v", fs)
			}
		})
	}

	// A stream jetbox creates supports exactly-once.
	_ = js.DeleteStream(ctx, prev)
	cfg := baseConfig()
	cfg.Delivery = sink.ExactlyOnce
	p := newPublisher(t, n, cfg)
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	for _, f := range p.Check(ctx, 10*time.Minute) {
		if strings.HasPrefix(f.Check, "nats.exactly_once") && f.Severity != check.Info {
			t.Fatalf("the stream jetbox created: %+v", f)
		}
	}
}
