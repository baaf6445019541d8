package main

// Typed flag values that never fail kong's parse. Kong stops at the first
// value its mapper refuses; these types record the value and the reason it
// does not parse instead, and RunFlags.Config reports every bad one, each
// with its fix, with the other problems of the configuration.

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kong"
)

// flagText is what a typed flag was given: from the command line, its
// JETBOX_* variable or its default (kong passes all three through Decode).
type flagText struct {
	// Text is the value as given, which the problems quote.
	Text string
	// Err is why Text is not a value of the flag's type; nil when it is.
	Err error
}

// failed reports whether the flag holds no valid value: its text did not
// parse, or it has none (no text is a value of any flag type; a flag
// that kong never decoded has none).
func (t flagText) failed() bool { return t.Err != nil || t.Text == "" }

// popText pops the flag's value, as kong's own string mapper does: only a
// missing value fails the parse.
func popText(ctx *kong.DecodeContext) (string, error) {
	var s string
	err := ctx.Scan.PopValueInto("string", &s)
	return s, err
}

// durationFlag is a Go duration flag (500ms, 30s, 2m).
type durationFlag struct {
	Value time.Duration
	flagText
}

// Decode implements kong.MapperValue.
func (d *durationFlag) Decode(ctx *kong.DecodeContext) error {
	s, err := popText(ctx)
	if err == nil {
		d.set(s)
	}
	return err
}

// set parses s.
func (d *durationFlag) set(s string) {
	d.Text = s
	d.Value, d.Err = time.ParseDuration(s)
}

// intFlag is a decimal integer flag (counts, limits).
type intFlag struct {
	Value int64
	flagText
}

// Decode implements kong.MapperValue.
func (n *intFlag) Decode(ctx *kong.DecodeContext) error {
	s, err := popText(ctx)
	if err == nil {
		n.set(s)
	}
	return err
}

// set parses s.
func (n *intFlag) set(s string) {
	n.Text = s
	n.Value, n.Err = strconv.ParseInt(s, 10, 64)
}

// sizeFlag is a byte size flag: 1048576, 512KiB, 16MiB, 1GiB or 2TiB (up to
// 1 PiB). It is the one type of every size flag.
type sizeFlag struct {
	Value int64 // bytes
	flagText
}

// Decode implements kong.MapperValue.
func (b *sizeFlag) Decode(ctx *kong.DecodeContext) error {
	s, err := popText(ctx)
	if err == nil {
		b.set(s)
	}
	return err
}

// set parses s.
func (b *sizeFlag) set(s string) {
	b.Text = s
	b.Value, b.Err = parseBytes(s)
}

// parseBytes reads sizes such as 1048576, 512KiB, 16MiB, 1GiB or 2TiB (up to 1 PiB).
func parseBytes(s string) (int64, error) {
	text := s
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n < 0 || n > (1<<50)/mult {
		return 0, fmt.Errorf("invalid size %q", text)
	}
	return n * mult, nil
}

// boolFlag is a boolean flag: written bare (--atomic-transactions) it is
// true; with a value (--flag=false, or its JETBOX_* variable) it is that
// value as strconv.ParseBool reads it.
type boolFlag struct {
	Value bool
	flagText
}

// Decode implements kong.MapperValue.
func (b *boolFlag) Decode(ctx *kong.DecodeContext) error {
	if ctx.Scan.Peek().Type != kong.FlagValueToken {
		b.set("true")
		return nil
	}
	b.set(fmt.Sprint(ctx.Scan.Pop().Value))
	return nil
}

// IsBool implements kong.BoolMapperValue: the flag may be given bare.
func (b *boolFlag) IsBool() bool { return true }

// set parses s.
func (b *boolFlag) set(s string) {
	b.Text = s
	b.Value, b.Err = strconv.ParseBool(s)
}
