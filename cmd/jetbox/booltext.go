package main

import (
	"fmt"

	"github.com/alecthomas/kong"
)

// boolText is a boolean flag kept as its text: written bare
// (--atomic-transactions) it is "true"; with a value (--flag=false, or its
// JETBOX_* variable) it keeps the text, which RunFlags.Config parses with
// every other value, so a bad one is reported with the other problems.
type boolText string

// Decode implements kong.MapperValue.
func (b *boolText) Decode(ctx *kong.DecodeContext) error {
	if ctx.Scan.Peek().Type != kong.FlagValueToken {
		*b = "true"
		return nil
	}
	t := ctx.Scan.Pop()
	*b = boolText(fmt.Sprint(t.Value))
	return nil
}

// IsBool implements kong.BoolMapperValue: the flag may be given bare.
func (b *boolText) IsBool() bool { return true }
