# v100-llm-box thermal guard for Windows (installed by roles/thermal_guard, run by WinSW as LocalSystem).
# The same rules as thermal_guard.py on Linux: sample every GPU with nvidia-smi each interval_s seconds; one "warn"
# event per episode at warn_c (memory: memory_warn_c); at stop_c (memory: memory_stop_c) stop the managed services
# through the service manager; start them again once every GPU is at or below resume_c (memory below
# memory_warn_c), at most max_restarts times in a rolling hour, after which they stay stopped ("limit") until the
# guard is restarted. A failing nvidia-smi is one "error" event per episode. Events: JSON lines in the events file
# and the Application event log (source v100box-thermal-guard).
[CmdletBinding()]
param (
    [Parameter(Mandatory)][string]$Config
)
$ErrorActionPreference = 'Stop'
$settings = Get-Content -LiteralPath $Config -Raw | ConvertFrom-Json
$sampleQuery = 'index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.mem,clocks_throttle_reasons.active'
$source = 'v100box-thermal-guard'
$entryType = @{ warn = 'Warning'; stop = 'Warning'; start = 'Information'; limit = 'Error'; error = 'Error' }
$eventId = @{ warn = 1001; stop = 1002; start = 1003; limit = 1004; error = 1005 }

function ConvertTo-Number([string]$Text) {
    $value = 0.0
    if ([double]::TryParse($Text.Trim(), [Globalization.NumberStyles]::Float, [Globalization.CultureInfo]::InvariantCulture, [ref]$value)) {
        return $value
    }
    return $null
}

function Format-Temp($Value) {
    if ($null -eq $Value) { return 'n/a' }
    return $Value.ToString([Globalization.CultureInfo]::InvariantCulture)
}

function Write-GuardEvent {
    param ([string]$Kind, $Gpu, $Temp, $MemoryTemp, $Service, [string]$Message)
    $record = [ordered]@{
        time = [DateTime]::UtcNow.ToString("yyyy-MM-dd'T'HH:mm:ss'+00:00'", [Globalization.CultureInfo]::InvariantCulture)
        kind = $Kind
        gpu = $Gpu
        temp_c = $Temp
        memory_temp_c = $MemoryTemp
        service = $Service
        message = $Message
    }
    $line = $record | ConvertTo-Json -Compress
    $folder = Split-Path -Parent $settings.events
    if (-not (Test-Path -LiteralPath $folder)) { New-Item -ItemType Directory -Path $folder -Force | Out-Null }
    Add-Content -LiteralPath $settings.events -Value $line -Encoding UTF8
    $text = if ($Service) { "${Kind}: $Message [$Service]" } else { "${Kind}: $Message" }
    Write-Output $text
    try {
        Write-EventLog -LogName Application -Source $source -EntryType $entryType[$Kind] -EventId $eventId[$Kind] -Message $text
    } catch {
        Write-Output "cannot write to the event log: $($_.Exception.Message)"
    }
}

function Get-Readings {
    $output = & nvidia-smi.exe "--query-gpu=$sampleQuery" '--format=csv,noheader,nounits' 2>&1
    if ($LASTEXITCODE -ne 0) { throw "nvidia-smi failed (exit $LASTEXITCODE): $($output -join ' ')" }
    $readings = @()
    foreach ($line in $output) {
        $fields = "$line".Split(',') | ForEach-Object { $_.Trim() }
        if ($fields.Count -lt 4 -or $fields[0] -notmatch '^[0-9]+$') { throw "nvidia-smi printed '$line', not a reading" }
        $readings += [pscustomobject]@{ Index = [int]$fields[0]; Temp = ConvertTo-Number $fields[2]; Memory = ConvertTo-Number $fields[3] }
    }
    return ,$readings
}

function Test-Hot($Reading, [double]$Core, [double]$MemoryLevel) {
    return (($null -ne $Reading.Temp -and $Reading.Temp -ge $Core) -or ($null -ne $Reading.Memory -and $Reading.Memory -ge $MemoryLevel))
}

function Test-Cool($Reading) {
    return (($null -eq $Reading.Temp -or $Reading.Temp -le $settings.resume_c) -and ($null -eq $Reading.Memory -or $Reading.Memory -lt $settings.memory_warn_c))
}

function Invoke-Services([string]$Kind, $Reading, [string]$Message) {
    if (@($settings.services).Count -eq 0) {
        Write-GuardEvent $Kind $Reading.Index $Reading.Temp $Reading.Memory $null "$Message (this box has none to manage)"
        return
    }
    foreach ($service in $settings.services) {
        try {
            if ($Kind -eq 'stop') { Stop-Service -Name $service -ErrorAction Stop } else { Start-Service -Name $service -ErrorAction Stop }
            Write-GuardEvent $Kind $Reading.Index $Reading.Temp $Reading.Memory $service $Message
        } catch {
            Write-GuardEvent 'error' $Reading.Index $Reading.Temp $Reading.Memory $service "$Kind of $service failed: $($_.Exception.Message)"
        }
    }
}

$warned = @{}
$stopped = $false
$limited = $false
$failing = $false
$restarts = New-Object System.Collections.ArrayList
$clock = [Diagnostics.Stopwatch]::StartNew()
while ($true) {
    $readings = $null
    try {
        $readings = Get-Readings
        if ($readings.Count -eq 0) { throw 'nvidia-smi lists no GPU' }
        $failing = $false
    } catch {
        if (-not $failing) {
            $failing = $true
            Write-GuardEvent 'error' $null $null $null $null "cannot read the GPU temperatures: $($_.Exception.Message); the guard keeps trying every $($settings.interval_s) s"
        }
        $readings = $null
    }
    if ($null -ne $readings) {
        $now = $clock.Elapsed.TotalSeconds
        $hot = @($readings | Where-Object { Test-Hot $_ $settings.stop_c $settings.memory_stop_c })
        if ($hot.Count -gt 0 -and -not $stopped) {
            $worst = $hot | Sort-Object -Property @('Temp', 'Memory') -Descending | Select-Object -First 1
            $stopped = $true
            foreach ($reading in $hot) { $warned[$reading.Index] = $true }
            Invoke-Services 'stop' $worst "GPU $($worst.Index) at $(Format-Temp $worst.Temp) C, memory $(Format-Temp $worst.Memory) C reached the stop level ($($settings.stop_c) C, memory $($settings.memory_stop_c) C): stopping the llama services"
            foreach ($t in @($restarts)) { if ($now - $t -ge 3600) { $restarts.Remove($t) } }
            if ($restarts.Count -ge $settings.max_restarts) {
                $limited = $true
                Write-GuardEvent 'limit' $worst.Index $worst.Temp $worst.Memory $null "the services were started again $($restarts.Count) times in the last hour (max_restarts $($settings.max_restarts)): they stay stopped; find the cooling fault, then start them and restart v100box-thermal-guard"
            }
        }
        foreach ($reading in $readings) {
            if ($warned.ContainsKey($reading.Index)) {
                if (Test-Cool $reading) { $warned.Remove($reading.Index) }
            } elseif (Test-Hot $reading $settings.warn_c $settings.memory_warn_c) {
                $warned[$reading.Index] = $true
                Write-GuardEvent 'warn' $reading.Index $reading.Temp $reading.Memory $null "GPU $($reading.Index) at $(Format-Temp $reading.Temp) C, memory $(Format-Temp $reading.Memory) C reached the warning level ($($settings.warn_c) C, memory $($settings.memory_warn_c) C)"
            }
        }
        $cool = @($readings | Where-Object { -not (Test-Cool $_) }).Count -eq 0
        if ($stopped -and -not $limited -and $cool) {
            $hottest = $readings | Sort-Object -Property @('Temp', 'Memory') -Descending | Select-Object -First 1
            $stopped = $false
            [void]$restarts.Add($now)
            Invoke-Services 'start' $hottest "every GPU is at or below $($settings.resume_c) C (hottest GPU $($hottest.Index) at $(Format-Temp $hottest.Temp) C): starting the llama services again"
        }
    }
    Start-Sleep -Milliseconds ([int]([double]$settings.interval_s * 1000))
}
