package sink

import "time"

// Defaults that New applies to a zero Config field. cmd/jetbox uses the same
// constants as its flag defaults, so each value has one source.
const (
	// DefaultPublishTimeout is how long one PubAck is waited for before the
	// outcome counts as unknown (Config.PublishTimeout, --publish-timeout).
	DefaultPublishTimeout = 30 * time.Second
	// DefaultMaxPending is the window of async publishes in flight
	// (Config.MaxPending). It is also --max-in-flight's default, the window
	// of the replication loop's tracker, which the sink's follows.
	DefaultMaxPending = 1024
	// DefaultMaxControlLine is nats-server's default max_control_line
	// (MAX_CONTROL_LINE_SIZE, 4 KiB; Config.MaxControlLine,
	// --nats-max-control-line). The server does not send its value in INFO,
	// so a server configured otherwise must be told.
	DefaultMaxControlLine = 4096
)

// controlLineReserve is what a publish's control line holds besides the
// subject, against max_control_line: nats-server measures the arguments of
// HPUB <subject> <reply> <header size> <total size> (not the verb or CRLF).
// jetbox's replies are nats.go's inboxes, at most 38 bytes (_INBOX. + 22 +
// . + 8 for a request, 20 for an async publish; jetbox refuses a custom
// inbox prefix): 64 leaves room. Two sizes of up to 10 digits, three spaces.
const controlLineReserve = 64 + 2*10 + 3
