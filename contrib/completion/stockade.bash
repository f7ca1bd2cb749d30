# bash completion for stockade(1)
_stockade()
{
    local cur prev words cword
    _init_completion || return

    local commands="run serve mcp sessions test check diff dry-run budget doctor soak version help"
    if [[ $cword -eq 1 ]]; then
        COMPREPLY=($(compgen -W "$commands --help --version" -- "$cur"))
        return
    fi

    local cmd=${words[1]} i
    # after `run ... --`: the tool's name and arguments are the policy's business
    for ((i = 2; i < cword; i++)); do
        [[ ${words[i]} == -- ]] && return
    done

    case $prev in
        --policy|--log|--metrics)
            _filedir
            return ;;
        --state-dir)
            _filedir -d
            return ;;
        --listen)
            COMPREPLY=($(compgen -W "unix:" -- "$cur"))
            compopt -o nospace
            return ;;
        --log-level)
            COMPREPLY=($(compgen -W "error warn info debug" -- "$cur"))
            return ;;
        --socket-group)
            COMPREPLY=($(compgen -g -- "$cur"))
            return ;;
        --isolation)
            COMPREPLY=($(compgen -W "process strict" -- "$cur"))
            return ;;
        --progress)
            COMPREPLY=($(compgen -W "auto tty plain none" -- "$cur"))
            return ;;
        --session|--timeout|--uid-range|--allow-uid|--admin-uid|--socket-mode|--max-message|\
        --drain-timeout|--session-ttl|\
        --metrics-interval|--duration|--concurrency|--report|--warmup|--sample-interval|\
        --churn-every|--mix|--seed|--rpc-timeout|--stop-timeout|--serve-arg|--stockade)
            return ;;
    esac

    local opts=""
    case $cmd in
        run) opts="--policy --session --state-dir --timeout --stdin --json --uid-range
                   --verbose --help --" ;;
        serve) opts="--policy --state-dir --listen --allow-uid --admin-uid --socket-mode
                     --socket-group --max-message --drain-timeout
                     --uid-range --log --log-level --metrics --metrics-interval --verbose
                     --help" ;;
        mcp) opts="--policy --state-dir --session-ttl --max-message --uid-range --log
                   --log-level --help" ;;
        sessions) opts="--state-dir --json --help list show rm gc" ;;
        test) opts="--help" ;;
        check) opts="--json --help" ;;
        diff) opts="--json --fail-on-widen --help" ;;
        dry-run) opts="--json --help" ;;
        budget) opts="--json --help" ;;
        doctor) opts="--json --help" ;;
        soak) opts="--stockade --policy --duration --concurrency --report --max-fd-growth
                    --max-rss-growth --rss-growth-floor --max-zombie-samples --max-errors
                    --warmup --sample-interval --churn-every --mix --isolation --state-dir
                    --keep-state --seed --progress --rpc-timeout --stop-timeout --serve-arg
                    --help" ;;
        version) opts="--help" ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
        return
    fi
    case $cmd in
        test|check|diff|dry-run|budget) _filedir lua ;;
    esac
} &&
    complete -F _stockade stockade
