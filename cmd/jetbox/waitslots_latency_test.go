package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// TestWaitForStandbySlotsLatency measures what --wait-for-standby-slots
// adds to the latency (the writer's clock before INSERT to the consumer's
// arrival, one process) of one-row transactions at a steady rate, with a
// streaming standby on loopback, fsync on for both servers
// (JETBOX_TEST_STANDBY_FSYNC=off: off); without and with the flag, per
// rate. It only measures:
//
//	JETBOX_TEST_STANDBY_LATENCY=500,2000 go test ./cmd/jetbox -run TestWaitForStandbySlotsLatency -v
func TestWaitForStandbySlotsLatency(t *testing.T) {
	spec := os.Getenv("JETBOX_TEST_STANDBY_LATENCY")
	if spec == "" {
		t.Skip("measures only: JETBOX_TEST_STANDBY_LATENCY=500,2000 (rows/s)")
	}
	var rates []int
	for _, s := range strings.Split(spec, ",") {
		r, err := strconv.Atoi(s)
		if err != nil || r < 1 {
			t.Fatalf("JETBOX_TEST_STANDBY_LATENCY: %q is not a rate", s)
		}
		rates = append(rates, r)
	}
	// fsync on by default (the standby's flush is a disk flush);
	// JETBOX_TEST_STANDBY_FSYNC=off leaves the gate's own cost.
	fsync := "on"
	if os.Getenv("JETBOX_TEST_STANDBY_FSYNC") == "off" {
		fsync = "off"
	}
	f := newFixture(t, withPG(testenv.WithSetting("fsync", fsync)))
	testenv.StartStandby(t, f.pg, "fsync="+fsync)
	const d = 10 * time.Second
	for _, rate := range rates {
		for _, flag := range []string{"", "standby1"} {
			p := f.start("JETBOX_WAIT_FOR_STANDBY_SLOTS="+flag, "JETBOX_LOG_LEVEL=info")
			f.waitStreaming(p)
			lat := measureLatency(t, f, rate, d)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
			f.waitSlotReleased()
			slices.Sort(lat)
			q := func(p float64) time.Duration { return lat[int(p*float64(len(lat)-1))] }
			what := "without the flag"
			if flag != "" {
				what = "--wait-for-standby-slots=standby1"
			}
			t.Logf("%d rows/s, %s: %d rows, p50 %s, p99 %s, max %s", rate, what, len(lat),
				q(0.5).Round(10*time.Microsecond), q(0.99).Round(10*time.Microsecond), lat[len(lat)-1].Round(10*time.Microsecond))
		}
	}
}

// measureLatency writes one-row transactions at rate for d (4 writers,
// each paced at rate/4) with the send time in the payload, and returns each
// row's latency to its arrival at a consumer of the stream.
func measureLatency(t *testing.T, f *fixture, rate int, d time.Duration) []time.Duration {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var lat []time.Duration
	cons, err := f.js.OrderedConsumer(ctx, "OUTBOX", jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	must(t, err)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		now := time.Now()
		var p struct {
			TS int64 `json:"ts"`
		}
		if json.Unmarshal(m.Data(), &p) == nil && p.TS > 0 {
			mu.Lock()
			lat = append(lat, now.Sub(time.Unix(0, p.TS)))
			mu.Unlock()
		}
	})
	must(t, err)
	defer cc.Stop()
	const writers = 4
	var wg sync.WaitGroup
	n := rate * int(d/time.Second) / writers
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn := f.pg.Conn(t)
			defer conn.Close(context.Background())
			interval := time.Second * writers / time.Duration(rate)
			next := time.Now()
			for i := 0; i < n; i++ {
				next = next.Add(interval)
				if wait := time.Until(next); wait > 0 {
					time.Sleep(wait) // pacing the load, not synchronisation
				}
				_, err := conn.Exec(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
					VALUES ('order', $1, 'OrderCreated', jsonb_build_object('ts', $2::bigint))`, fmt.Sprintf("w%d", w), time.Now().UnixNano())
				if err != nil {
					t.Errorf("insert: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	testenv.WaitFor(t, time.Minute, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(lat) < n*writers {
			return fmt.Errorf("%d of %d rows arrived", len(lat), n*writers)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	return slices.Clone(lat)
}
