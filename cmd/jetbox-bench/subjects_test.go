package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestSubjectIndexCost measures what {aggregate_id} in the subject costs
// the server (docs/routing.md): the heap of an in-process nats-server
// holding 1,000,000 messages on 1,000,000 distinct subjects
// (outbox.order.<id>.E) against 1,000,000 messages on 1,000 subjects, both
// file streams. It fails above 1 KiB per subject. Set
// JETBOX_MEASURE_SUBJECTS=N to run it with N messages (e.g. 1000000).
func TestSubjectIndexCost(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("JETBOX_MEASURE_SUBJECTS"))
	if n < 1000 {
		t.Skip("set JETBOX_MEASURE_SUBJECTS=1000000 to measure")
	}
	js := startJetStream(t, t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	heap := func() uint64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse
	}
	fill := func(name string, subjects int) uint64 {
		t.Helper()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.FileStorage}); err != nil {
			t.Fatal(err)
		}
		payload := []byte(`{"n": 1}`)
		for i := 0; i < n; i++ {
			if _, err := js.PublishAsync(fmt.Sprintf("%s.order.%d.E", name, i%subjects), payload); err != nil {
				t.Fatal(err)
			}
			if i%10000 == 9999 {
				select {
				case <-js.PublishAsyncComplete():
				case <-ctx.Done():
					t.Fatal("publish timeout")
				}
			}
		}
		<-js.PublishAsyncComplete()
		st, _ := js.Stream(ctx, name)
		info, _ := st.Info(ctx, jetstream.WithSubjectFilter(name+".>"))
		h := heap()
		t.Logf("stream %s: %d messages, %d subjects, server+client heap %d MiB", name, info.State.Msgs, info.State.NumSubjects, h>>20)
		return h
	}
	base := heap()
	few := fill("few", 1000)
	if err := js.DeleteStream(ctx, "few"); err != nil {
		t.Fatal(err)
	}
	afterDelete := heap()
	many := fill("many", n)
	perSubject := (float64(many) - float64(few)) / float64(n-1000)
	t.Logf("base %d MiB, after deleting few %d MiB; distinct subjects cost %.0f bytes each (%d MiB for %d subjects)",
		base>>20, afterDelete>>20, perSubject, (many-few)>>20, n)
	if perSubject > 1024 {
		t.Fatalf("%.0f bytes per subject", perSubject)
	}
}
