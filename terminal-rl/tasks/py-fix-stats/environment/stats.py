"""Summary statistics of numbers read from standard input."""
import sys


def read_numbers(stream):
    numbers = []
    for line in stream:
        line = line.strip()
        if line.startswith("#"):
            continue
        numbers.append(float(line))
    return numbers


def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def mode(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = max(counts.values())
    return [x for x in counts if counts[x] == best][-1]


def main():
    xs = read_numbers(sys.stdin)
    print(f"count {len(xs)}")
    print(f"mean {mean(xs):.2f}")
    print(f"median {median(xs):.2f}")
    print(f"mode {mode(xs):.2f}")


if __name__ == "__main__":
    main()
