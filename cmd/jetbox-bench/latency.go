package main

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The steady-state producers put their send time into each payload, as
// {"ts": <unix nanoseconds>, "pad": "xx…"} (the key order jsonb renders), and
// the consumer subtracts it from its receive time: the same process and clock.

// timedPayload returns a payload of size bytes carrying the send time now.
func timedPayload(now time.Time, size int) []byte {
	b := make([]byte, 0, size)
	b = append(b, `{"ts": `...)
	b = strconv.AppendInt(b, now.UnixNano(), 10)
	b = append(b, `, "pad": "`...)
	for len(b) < size-2 {
		b = append(b, 'x')
	}
	return append(b, `"}`...)
}

var tsKey = []byte(`"ts":`)

// sendTime reads the send time back from a payload (as sent or as jsonb
// renders it).
func sendTime(payload []byte) (time.Time, error) {
	i := bytes.Index(payload, tsKey)
	if i < 0 {
		return time.Time{}, fmt.Errorf("payload %.40q has no send time", payload)
	}
	rest := bytes.TrimLeft(payload[i+len(tsKey):], " ")
	end := 0
	for end < len(rest) && rest[end] >= '0' && rest[end] <= '9' {
		end++
	}
	ns, err := strconv.ParseInt(string(rest[:end]), 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("payload %.40q: send time: %w", payload, err)
	}
	return time.Unix(0, ns), nil
}

// latencyConsumer is an ordered consumer on a stream that records, for every
// new message, the time from its send time to its arrival, and to when the
// stream stored it (which splits the latency into the forwarder's part and
// the consumer's).
type latencyConsumer struct {
	cc jetstream.ConsumeContext

	mu      sync.Mutex
	samples []latencySample
	count   int
	err     error // the first malformed message
}

// latencySample is one message's latencies from its send time.
type latencySample struct {
	id       string        // Nats-Msg-Id (the outbox id for a forwarder's message)
	sent     time.Time     // the send time in the payload
	consumer time.Duration // send → consumer
	stored   time.Duration // send → stored in the stream (server timestamp)
}

// startLatencyConsumer starts consuming the messages stream stores from now on.
func (b *bench) startLatencyConsumer(ctx context.Context, stream string) (*latencyConsumer, error) {
	s, err := b.srv.js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		return nil, fmt.Errorf("consumer on %s: %w", stream, err)
	}
	c := &latencyConsumer{}
	c.cc, err = cons.Consume(c.handle)
	if err != nil {
		return nil, fmt.Errorf("consume %s: %w", stream, err)
	}
	return c, nil
}

func (c *latencyConsumer) handle(m jetstream.Msg) {
	now := time.Now()
	sent, err := sendTime(m.Data())
	var md *jetstream.MsgMetadata
	if err == nil {
		md, err = m.Metadata()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.count++
	if err != nil {
		if c.err == nil {
			c.err = err
		}
		return
	}
	c.samples = append(c.samples, latencySample{id: m.Headers().Get(jetstream.MsgIDHeader), sent: sent, consumer: now.Sub(sent), stored: md.Timestamp.Sub(sent)})
}

// waitCount waits until the consumer received n messages in all, or timeout passes.
func (c *latencyConsumer) waitCount(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		c.mu.Lock()
		got, err := c.count, c.err
		c.mu.Unlock()
		switch {
		case err != nil:
			return err
		case got > n:
			return fmt.Errorf("consumer received %d messages, %d were sent", got, n)
		case got == n:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("consumer received %d of %d messages within %s", got, n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// take returns the latencies recorded so far and starts a new set.
func (c *latencyConsumer) take() []latencySample {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.samples
	c.samples = nil
	return out
}

func (c *latencyConsumer) stop() { c.cc.Stop() }

// latencyStats summarises INSERT (or publish) → consumer latencies.
type latencyStats struct {
	N                        int
	P50, P90, P99, P999, Max time.Duration
	Mean                     time.Duration
}

// summarize sorts samples (in place) and returns its percentiles.
func summarize(samples []time.Duration) latencyStats {
	if len(samples) == 0 {
		return latencyStats{}
	}
	slices.Sort(samples)
	at := func(q float64) time.Duration { return samples[min(len(samples)-1, int(q*float64(len(samples))))] }
	var sum time.Duration
	for _, d := range samples {
		sum += d
	}
	return latencyStats{N: len(samples), P50: at(0.50), P90: at(0.90), P99: at(0.99), P999: at(0.999), Max: samples[len(samples)-1],
		Mean: sum / time.Duration(len(samples))}
}
