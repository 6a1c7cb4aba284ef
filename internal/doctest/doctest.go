// Package doctest keeps the code that README.md shows identical to compiled example files:
// a test of the example's package calls ShowsFile, so an edit to one without the other
// fails the suite.
package doctest

import (
	"os"
	"strings"
	"testing"
)

// ShowsFile fails tb unless the Markdown file readme has a ```go code block whose text is
// exactly goFile's after its package clause: from the line after "package ...", blank
// lines at either end trimmed. A file shown in README.md thus holds its imports and its
// example functions only.
func ShowsFile(tb testing.TB, readme, goFile string) {
	tb.Helper()
	src, err := os.ReadFile(goFile)
	if err != nil {
		tb.Fatal(err)
	}
	md, err := os.ReadFile(readme)
	if err != nil {
		tb.Fatal(err)
	}
	want, ok := afterPackageClause(string(src))
	if !ok {
		tb.Fatalf("%s has no package clause", goFile)
	}
	blocks := GoBlocks(string(md))
	for _, b := range blocks {
		if b == want {
			return
		}
	}
	// Name the block most like the file (the most lines in common), and its first
	// differing line.
	wl := strings.Split(want, "\n")
	best, bestCommon := -1, 0
	for i, b := range blocks {
		have := map[string]bool{}
		for _, l := range strings.Split(b, "\n") {
			have[l] = true
		}
		common := 0
		for _, l := range wl {
			if have[l] && strings.TrimSpace(l) != "" {
				common++
			}
		}
		if common > bestCommon {
			best, bestCommon = i, common
		}
	}
	if best >= 0 && bestCommon*2 > len(wl) {
		bl := strings.Split(blocks[best], "\n")
		for i := range max(len(bl), len(wl)) {
			var got, exp string
			if i < len(bl) {
				got = bl[i]
			}
			if i < len(wl) {
				exp = wl[i]
			}
			if got != exp {
				tb.Errorf("%s shows %s differently: line %d of its block is %q, the file has %q", readme, goFile, i+1, got, exp)
				break
			}
		}
	}
	tb.Errorf("%s has no ```go block identical to %s after its package clause; paste it:\n%s", readme, goFile, want)
}

// GoBlocks returns the text of every ```go fenced block of the Markdown md, without the
// fences, blank lines at either end trimmed.
func GoBlocks(md string) []string {
	var blocks []string
	lines := strings.Split(md, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```go" {
			continue
		}
		var body []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			body = append(body, lines[i])
		}
		blocks = append(blocks, strings.Trim(strings.Join(body, "\n"), "\n"))
	}
	return blocks
}

// afterPackageClause returns src after its "package" line, blank lines at either end trimmed.
func afterPackageClause(src string) (string, bool) {
	lines := strings.Split(src, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "package ") {
			return strings.Trim(strings.Join(lines[i+1:], "\n"), "\n"), true
		}
	}
	return "", false
}
